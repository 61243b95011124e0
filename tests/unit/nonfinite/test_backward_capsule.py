"""The capsule of a backward NaN (issue 38, item 2): drafted at the backward's end, before
the update, named by the step it holds, replayed by `hookprof replay` from the gradients the
outputs received (no loss function needed) to the same first layer; where it cannot be kept
(a device behind the host without nonfinite_sync), no file, and one line says why."""

from __future__ import annotations

import logging
import os
import re

import torch
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.nonfinite import reproduce
from support.first_nan import UNSAMPLED, behind_by
from support.own_hooks import OwnHooks


def fp16_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    ).half()


def overflowing_run(directory, *, lag=0, **settings):
    """A float16 MLP with a static loss scale of 1024: its step-2 gradients overflow, first
    in the last Linear (test_natural_divergence.py). Returns (prof, own hooks' first,
    the state_dict as step 2's forward used it)."""
    _testing.forget_capsules_written()
    model = fp16_mlp()
    own = OwnHooks()
    g = torch.Generator().manual_seed(1)
    before = {}
    with behind_by(lag):
        prof = hookprof.attach(
            model,
            config=hookprof.Config(
                summary_at_exit=False, capsule_dir=str(directory), **UNSAMPLED, **settings
            ),
        )
        own.replaying = lambda: _testing.replaying(prof)
        own.watch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for step in range(1, 5):
                x, y = torch.randn(32, 16, generator=g).half(), torch.randn(32, 1, generator=g)
                if step == 2:
                    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x).float(), y)
                (loss * 1024.0).backward()
                opt.step()
                own.stepped()
            prof.flush()
        finally:
            own.remove()
            prof.detach()
    return prof, own.first(), before


def test_a_backward_nan_gets_a_capsule_of_its_own_step_that_replays_to_its_layer(tmp_path):
    prof, own, before = overflowing_run(tmp_path)
    assert own == ("backward", "4", 2)
    event = prof.snapshot().first_nonfinite
    assert (event.layer, event.phase, event.step) == ("4", "backward", 2)
    path = event.capsule
    assert path is not None and re.fullmatch(
        rf"hookprof-capsule-Sequential-rank0-step2-{os.getpid()}\.pt", os.path.basename(path)
    )
    capsule = torch.load(path, map_location="cpu", weights_only=True)
    assert capsule["view"]["form"] == "backward" and capsule["view"]["step"] == 2
    assert capsule["view"]["weights_intact"] is True
    # the model as step 2's forward ran it: before that step's (non-finite) update
    model = torch.load(__import__("io").BytesIO(capsule["model"]["pickle"]), weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    lines = []
    assert reproduce.replay(path, say=lines.append) == reproduce.REPRODUCED
    assert (
        lines[0]
        == "reproduced: NaN/Inf in the backward, first in the gradient of 4.weight (layer 4)"
        or lines[0]
        == "reproduced: NaN/Inf in the backward, first in the gradient of 4.bias (layer 4)"
    )
    assert "hookprof said: backward, layer 4" in lines[1]


def test_behind_the_host_without_nonfinite_sync_no_capsule_and_why(tmp_path, caplog):
    """On a device behind the host the backward's check is read after the update: no
    capsule (a later step's forward would replay the consequence), and one line says why."""
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        prof, own, _ = overflowing_run(tmp_path, lag=3)
    event = prof.snapshot().first_nonfinite
    assert (event.phase, event.step) == ("backward", 2) and event.capsule is None
    assert os.listdir(tmp_path) == []
    said = [r.getMessage() for r in caplog.records if "no capsule written" in r.getMessage()]
    assert len(said) == 1, said
    assert "step 2 (backward)" in said[0] and "nonfinite_sync=True" in said[0]


def test_behind_the_host_with_nonfinite_sync_the_capsule_is_kept(tmp_path):
    prof, own, _ = overflowing_run(tmp_path, lag=3, nonfinite_sync=True)
    event = prof.snapshot().first_nonfinite
    assert (event.layer, event.phase, event.step) == ("4", "backward", 2)
    assert event.capsule is not None and "-step2-" in event.capsule
    assert reproduce.replay(event.capsule, say=lambda line: None) == reproduce.REPRODUCED


def test_a_loss_nan_says_why_it_has_no_capsule(tmp_path, caplog):
    model = nn.Linear(4, 1)
    _testing.forget_capsules_written()
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(
            model,
            config=hookprof.Config(summary_at_exit=False, capsule_dir=str(tmp_path), **UNSAMPLED),
        ) as prof:
            for step in range(1, 4):
                out = model(torch.ones(2, 4))
                loss = out.sum() * (float("inf") if step == 2 else 1.0)
                prof.step(loss.detach())
            prof.flush()
    said = [r.getMessage() for r in caplog.records if "no capsule written" in r.getMessage()]
    assert len(said) == 1 and "step 2 (loss)" in said[0] and "loss alone" in said[0]
    assert os.listdir(tmp_path) == []


def test_two_forwards_of_different_shapes_in_one_step_never_raise_into_backward(tmp_path):
    """Review H2: the model called twice per step, three output tensors then one, both in
    the loss: the first forward's node hooks wrote into the second's list, an IndexError
    inside the user's backward()."""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, many: bool):
            return (self.a(x), self.b(x), self.a(x) * 2) if many else self.b(x)

    model = TwoHeads()
    _testing.forget_capsules_written()
    with hookprof.attach(
        model, config=hookprof.Config(summary_at_exit=False, capsule_dir=str(tmp_path), **UNSAMPLED)
    ) as prof:
        for _ in range(3):
            model.zero_grad()
            first = model(torch.randn(2, 4), True)
            second = model(torch.randn(2, 4), False)
            (sum(t.sum() for t in first) + second.sum()).backward()
        prof.flush()
        assert prof.snapshot().internal_errors == 0
        assert prof._backward_end.output_grads == []  # released once the step's check read them


def test_a_gradscaler_overflow_leaves_the_capsule_for_the_real_incident(tmp_path):
    """Review H3: GradScaler's normal overflow at step 1 (its step skipped) drafted a
    backward capsule that stayed, and the real NaN of step 6 got none."""
    _testing.forget_capsules_written()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at once, then backs off
    g = torch.Generator().manual_seed(1)
    with hookprof.attach(
        model, config=hookprof.Config(summary_at_exit=False, capsule_dir=str(tmp_path), **UNSAMPLED)
    ) as prof:
        for step in range(1, 9):
            x = torch.randn(4, 8, generator=g)
            if step == 6:  # a row that overflows the first layer's first unit: the real incident
                x[0] = 3e38 * torch.sign(model[0].weight[0].detach())
            opt.zero_grad()
            scaler.scale(model(x).pow(2).sum() * 10.0).backward()  # x 2**127: inf at step 1
            scaler.step(opt)
            scaler.update()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert scaler.get_scale() < 2.0**127  # it did overflow and skip
    assert (event.phase, event.step, event.layer) == ("forward", 6, "0")
    assert event.capsule is not None and "-step6-" in event.capsule
