"""The first NaN where the simple cases end (found by the review of issue 28): several
forwards per step, an attention mask's -inf, gradients not checked every step, a NaN the
root's own code makes between layers. Each answer is either a layer with how it was found,
or no layer with the reason, and never a claim hookprof cannot back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.nonfinite.attribution import WEIGHTS_UNPROVEN
from hookprof.nonfinite.replay import EARLIER_FORWARD
from support.first_nan import EVERY_STEP_CHECKED, LAGS, UNSAMPLED, behind_by
from support.lagging_device import lagging_device

BAD_STEP = 5


def train(
    model,
    steps,
    *,
    lag=0,
    settings=UNSAMPLED,
    policy="record",
    micro_batches=1,
    before_step=lambda step, model: None,
    batch=None,
):
    """A plain loop with a fused SGD on the emulated device `lag` steps behind; returns the
    event after flush()."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    context = lagging_device(lag) if lag else _nothing()
    with context:
        prof = hookprof.attach(model, summary_at_exit=False, on_nonfinite=policy, **settings)
        try:
            for step in range(1, steps + 1):
                before_step(step, model)
                opt.zero_grad(set_to_none=True)
                for micro in range(micro_batches):
                    x = batch(step, micro, g) if batch else torch.randn(6, 4, generator=g)
                    (model(x).float().pow(2).mean() / micro_batches).backward()
                opt.step()
            prof.flush()
            return prof.snapshot().first_nonfinite, prof.report()
        finally:
            prof.detach()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("lag", LAGS)
def test_a_nan_in_an_earlier_micro_batch_is_said_not_replayed_not_left_pending(lag):
    """Gradient accumulation over 2 micro-batches; step 5's first micro-batch holds an Inf,
    its second is finite. On the CPU the bad forward's flag is on the host at its output,
    so that very forward is replayed: "(input)". On a device behind, the flags arrive after
    the step: the replay covers a step's last forward, which cannot answer, so the event
    says so (not "not yet localised" for ever)."""

    def batch(step, micro, g):
        x = torch.randn(6, 4, generator=g)
        if step == BAD_STEP and micro == 0:
            x[0, 0] = float("inf")
        return x

    event, report = train(Mlp(), BAD_STEP + 2 * lag + 3, lag=lag, micro_batches=2, batch=batch)
    if lag == 0:
        assert (event.layer, event.step, event.found_by, event.replay) == (
            "(input)",
            BAD_STEP,
            "input",
            "reproducible",
        )
    else:
        assert (event.layer, event.phase, event.step) == (None, "forward", BAD_STEP)
        assert (event.replay, event.replay_note) == ("not replayed", EARLIER_FORWARD)
    assert "not yet localised" not in report


class MaskedAttention(nn.Module):
    """Scores plus an additive causal mask (-inf above the diagonal, as
    nn.Transformer.generate_square_subsequent_mask makes), then a layer that makes a NaN at
    its `at`-th call only (a stateful fault: its replay is finite)."""

    def __init__(self, at: int):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.fault = Fault(at)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        scores = self.proj(x) + torch.triu(torch.full((x.shape[0], 4), float("-inf")), 1)
        return self.out(self.fault(torch.softmax(scores, dim=-1)))


class Fault(nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == self.at else x


def test_an_attention_masks_minus_inf_is_no_evidence_the_nan_reproduced():
    """The mask's -inf is in an output every step (proj's scores plus the mask are finite,
    the mask itself is made inside the forward here): the stateful fault's replay is finite,
    so the NaN is transient, not "reproducible" and not "(input)"."""
    event, _ = train(MaskedAttention(BAD_STEP), BAD_STEP + 2)
    assert (event.layer, event.step, event.found_by, event.replay) == (
        None,
        BAD_STEP,
        None,
        "transient",
    )


class MaskedInput(MaskedAttention):
    """The -inf comes in with the batch (an additive mask passed as input)."""

    def forward(self, x):
        x, mask = x[:, :4], x[:, 4:]
        return self.out(self.fault(torch.softmax(self.proj(x) + mask, dim=-1)))


def test_a_minus_inf_mask_in_the_batch_does_not_make_a_transient_nan_the_inputs():
    def batch(step, micro, g):
        x = torch.randn(6, 4, generator=g)
        return torch.cat([x, torch.triu(torch.full((6, 4), float("-inf")), 1)], dim=1)

    event, _ = train(MaskedInput(BAD_STEP), BAD_STEP + 2, batch=batch)
    assert (event.layer, event.step, event.found_by, event.replay) == (
        None,
        BAD_STEP,
        None,
        "transient",
    )


def test_with_gradients_unchecked_weights_made_nan_by_an_update_are_no_evidence():
    """nonfinite_check="loss": an unsampled step's gradients are not checked. A NaN gradient
    of fc1 at step 5 reaches its weights; step 6's forward is then NaN from fc1's weights.
    Nothing says whether an update made them so, so no layer is named from them (it would
    read "before any non-finite update", which is not known), and the event says why."""

    def before_step(step, model):
        if step == BAD_STEP:
            model.poison = model.fc1.weight.register_hook(lambda g: g * float("nan"))
        elif step == BAD_STEP + 1:
            model.poison.remove()

    event, report = train(
        Mlp(),
        BAD_STEP + 3,
        settings=dict(UNSAMPLED, nonfinite_check="loss"),
        before_step=before_step,
    )
    assert (event.layer, event.phase, event.step) == (None, "forward", BAD_STEP + 1)
    assert event.found_by is None and event.replay == "reproducible"
    assert event.replay_note == WEIGHTS_UNPROVEN
    assert "not yet localised" not in report


class RootMath(nn.Module):
    """The root's own code (no module) makes the NaN between fc1 and fc2 at one step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        self.bad = False

    def forward(self, x):
        h = self.fc1(x)
        if self.bad:
            h = torch.log(h - 1e6)  # log of a negative number: NaN, made by the root's code
        return self.fc2(h)


def test_a_nan_made_by_the_roots_own_code_on_a_checked_step_names_the_root():
    """On a checked step only the layers are hooked: they see fc2 get a NaN input, no
    producer. The replay (which also runs on checked steps) hooks the containers too and
    names the root, after fc1 ran finite."""

    def before_step(step, model):
        model.bad = step == BAD_STEP

    event, report = train(
        RootMath(), BAD_STEP + 2, settings=EVERY_STEP_CHECKED, before_step=before_step
    )
    assert (event.layer, event.phase, event.step) == ("(root)", "forward", BAD_STEP)
    assert (event.found_by, event.replay, event.last_finite_child) == (
        "replay",
        "reproducible",
        "fc1",
    )
    assert "not yet localised" not in report


def test_another_models_optimizer_does_not_make_a_replay_inconclusive():
    """A GAN-like loop on a device behind the host with nonfinite_sync: the other model's
    optimizer steps between this model's forward and its update. Only this model's updates
    change its weights, so the on-time replay of the stateful fault is still a verdict:
    transient (counting every optimizer of the process made it "not replayed")."""
    model, other = nn.Sequential(nn.Linear(4, 4), Fault(BAD_STEP), nn.Linear(4, 2)), Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    other_opt = torch.optim.SGD(other.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with lagging_device(1):
        prof = hookprof.attach(model, summary_at_exit=False, nonfinite_sync=True, **UNSAMPLED)
        try:
            for _ in range(BAD_STEP + 3):
                opt.zero_grad(set_to_none=True)
                other_opt.zero_grad(set_to_none=True)
                model(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
                other(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
                other_opt.step()  # another model's update, before this model's
                opt.step()
            prof.flush()
            event = prof.snapshot().first_nonfinite
        finally:
            prof.detach()
    assert (event.layer, event.step, event.replay) == (None, BAD_STEP, "transient")


@pytest.mark.parametrize("lag", [0, 1])
def test_an_fp16_overflow_under_autocast_replays_in_fp16(lag):
    """A row whose layer-0 output is 80,000: past float16's 65,504 under CPU autocast, finite
    in float32. On a device behind the host the replay runs at the update, outside the loop's
    autocast block: it runs in the forward's autocast again (before: in float32, finite, and
    the NaN was never named)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, fused=True)
    with behind_by(lag):
        prof = hookprof.attach(model, port=0, summary_at_exit=False, on_nonfinite="skip")
        try:
            for step in range(1, 8):
                x = torch.rand(4, 8)
                if step == 4:
                    x[0] = 20000.0  # 8 x 0.5 x 20,000
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                out.float().square().mean().backward()
                opt.step()
            prof.flush()
            event = prof.snapshot().first_nonfinite
        finally:
            prof.detach()
    assert (event.layer, event.phase, event.step, event.replay) == (
        "0",
        "forward",
        4,
        "reproducible",
    )
