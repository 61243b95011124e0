"""Issue 43 items 3-5 on the CPU: the scheduled replay check. Each check step's forward is
replayed before its update and every layer's output compared bitwise with the step's own.
A bit flipped inside one layer's computation on one step (the test's own fault, in that
layer's forward, where a failing device would put it) is caught: not reproduced, that layer
and step named. The same flip in the input batch is reproduced (the data, not the machine).
A healthy run reproduces every check and trains to the same bits as without hookprof."""

from __future__ import annotations

import io
import os
import random
import sys

import pytest
import torch
from torch import nn

import hookprof
import hookprof.step.hooks as hooks_module
from hookprof.integrity.replay_check import COMPILED_REGIONS, NOT_CAPTURED, SEVERAL_FORWARDS
from hookprof.view.report_html import render
from hookprof.view.summary import summary_text
from hookprof.view.table import from_metrics, header_lines
from support.capsules import replay_in_new_process
from support.metrics import parse, scrape
from support.models import DirectForwardNet, ReplayCheckNet
from support.rendered import Elements

EVERY_STEP = 1e-9  # sdc_check_interval_s: a period of one step, every step a check step
FAULT_STEP = 7


# (importable by name: `hookprof replay` of a check's capsule unpickles it in a new process)
Net = ReplayCheckNet


def flip_bit(t: torch.Tensor, index: tuple[int, ...] = (1, 3), bit: int = 12) -> torch.Tensor:
    """`t` with one bit of one float32 flipped (a copy: the fault is the value it holds)."""
    out = t.clone()
    out.view(torch.int32)[index] ^= 1 << bit
    return out


def train(steps: int, prof_config: dict | None, fault=None) -> tuple[list[float], object]:
    """Train Net for `steps` (with hookprof when `prof_config` is given, else bare); `fault(
    model, step, x) -> x` may change things on a step. Returns the losses and the profiler's
    final snapshot (or None)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    if fault is not None:
        fault(model, 1, None)  # (its hooks go in before hookprof's)
    prof = hookprof.attach(model, port=0, **prof_config) if prof_config is not None else None
    losses = []
    try:
        for step in range(1, steps + 1):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            if fault is not None:
                x = fault(model, step, x)
            opt.zero_grad(set_to_none=True)
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            if prof is not None:
                prof.step(loss)
            losses.append(loss.item())
        if prof is None:
            return losses, None
        prof.flush()
        text = scrape(prof.url)
        train.seen = (text, prof.report_document())  # what a person reads, for the views' test
        return losses, (prof.snapshot(), parse(text))
    finally:
        if prof is not None:
            prof.detach()


def flip_in_layer(layer: str):
    """A fault in `layer`'s output on FAULT_STEP's forward: one bit flipped by a forward hook
    of the test's own, registered before hookprof's (so every hook after it, hookprof's
    included, sees the wrong value, as they would a failing device's); the replay, under
    no_grad, computes it right."""
    armed = {"step": False}

    def flip_once(module, args, output):
        if armed["step"] and torch.is_grad_enabled():  # the step's own forward, not the replay
            armed["step"] = False
            return flip_bit(output)
        return None

    def fault(model, step, x):
        if x is None:  # before attach
            dict(model.named_modules())[layer].register_forward_hook(flip_once)
        armed["step"] = step == FAULT_STEP
        return x

    return fault


def checks(page) -> dict[str, float]:
    return {
        s.labels["result"]: s.value
        for s in page["hookprof_replay_checks"].samples
        if s.name == "hookprof_replay_checks_total"
    }


def test_a_healthy_run_reproduces_every_check_and_trains_to_the_same_bits():
    bare, _ = train(30, None)
    watched, (snap, page) = train(30, {"sdc_check_interval_s": EVERY_STEP})
    assert watched == bare  # the replays left the RNG, BatchNorm's buffers and weights alone
    assert snap.replay_checks["reproduced"] >= 25
    assert snap.replay_checks["not_reproduced"] == 0 and snap.replay_mismatch is None
    assert snap.replay_checks["not_compared"] == 0
    assert checks(page) == {k: float(v) for k, v in snap.replay_checks.items()}
    assert "hookprof_replay_mismatch_info" not in page


@pytest.mark.parametrize("layer", ["fc1", "act", "fc2"])
def test_a_bit_flipped_inside_a_layer_is_not_reproduced_and_that_layer_named(layer):
    _, (snap, page) = train(15, {"sdc_check_interval_s": EVERY_STEP}, flip_in_layer(layer))
    assert snap.replay_checks["not_reproduced"] == 1
    mismatch = snap.replay_mismatch
    assert (mismatch.layer, mismatch.step) == (layer, FAULT_STEP)
    [info] = page["hookprof_replay_mismatch_info"].samples
    assert (info.labels["layer"], info.labels["step"]) == (layer, str(FAULT_STEP))
    assert snap.replay_checks["reproduced"] >= 10  # every other check step


def test_the_same_flip_in_the_input_batch_is_reproduced():
    """The data, not the machine: the replay runs on the same (wrong) batch."""

    def flip_input(model, step, x):
        return flip_bit(x, (2, 5), 30) if x is not None and step == FAULT_STEP else x

    _, (snap, _) = train(15, {"sdc_check_interval_s": EVERY_STEP}, flip_input)
    assert snap.replay_checks["not_reproduced"] == 0 and snap.replay_mismatch is None
    assert snap.replay_checks["reproduced"] >= 12


def micro_batch_steps(steps: int, micro_batches: int) -> tuple[object, str | None]:
    """A small model trained with gradient accumulation, a check on every step; returns the
    snapshot and the last reason a check was not compared."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(micro_batches):
                model(torch.randn(2, 4)).sum().backward()
            opt.step()
            prof.step()
        prof.flush()
        return prof.snapshot(), prof._publisher._aggregator.replay.last_refusal


def test_a_step_of_two_forwards_is_not_compared_with_its_reason():
    snap, last = micro_batch_steps(6, 2)
    assert snap.replay_checks["not_compared"] >= 4 and snap.replay_checks["reproduced"] == 0
    assert last == SEVERAL_FORWARDS


def test_a_person_sees_the_mismatch_in_top_the_summary_and_the_report():
    _, (snap, _) = train(12, {"sdc_check_interval_s": EVERY_STEP}, flip_in_layer("fc2"))
    page, document = train.seen
    counts = snap.replay_checks
    expected = (
        f"replay checks: {counts['reproduced']} reproduced, 1 not reproduced (latest: fc2's "
        f"output differed at step {FAULT_STEP}: the machine, not the data)"
    )
    (table,) = from_metrics(page)  # hookprof top reads the page
    assert [x.strip() for x in header_lines([table.header]) if "replay" in x] == [expected]
    assert expected in summary_text(snap, "Net")
    report = "".join(Elements(render([document])).text)
    assert (
        f"{counts['reproduced']:,} reproduced, 1 not reproduced (latest: fc2's output differed "
        f"at step {FAULT_STEP:,}: the machine, not the data)"
    ) in report


# ---------------- forwards that keep state (review of the replay check) ----------------


class Counted(nn.Module):
    """A layer that counts its calls in a private attribute and scales by it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self._calls = 0

    def forward(self, x):
        self._calls += 1
        return self.fc(x) * (1 + 0.01 * self._calls)


class StochasticDepth(nn.Module):
    """Skips its block at random with Python's own generator (timm's drop path, written with
    `random`)."""

    def __init__(self):
        super().__init__()
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return x if random.random() < 0.5 else x + self.b(x)


def spectral() -> nn.Module:
    """Spectral norm's power iteration updates its vectors in place at every training
    forward, and reads them: the replay must start from them as they were."""
    return nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 8)
    )


def train_any(make_model, steps: int = 12, config: dict | None = None, aux: bool = False):
    """`make_model()` trained with SGD on a fixed stream (with hookprof and `config` when
    given); `aux`: a layer of the model is also called outside its forward, into the loss.
    Returns the losses and the profiler's snapshot (or None)."""
    torch.manual_seed(0)
    random.seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    prof = hookprof.attach(model, port=0, **config) if config is not None else None
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(4, 8, generator=g)
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            if aux:
                loss = loss + model[-1](x).mean()  # a layer called outside the root's forward
            loss.backward()
            opt.step()
            if prof is not None:
                prof.step()
            losses.append(loss.item())
        if prof is not None:
            prof.flush()
            train_any.last_refusal = prof._publisher._aggregator.replay.last_refusal
            return losses, prof.snapshot()
        return losses, None
    finally:
        if prof is not None:
            prof.detach()


@pytest.mark.parametrize(
    "make_model",
    [
        lambda: nn.Sequential(Counted(), nn.ReLU(), nn.Linear(8, 8)),
        lambda: nn.Sequential(StochasticDepth(), StochasticDepth(), nn.Linear(8, 8)),
        spectral,
    ],
    ids=["private counter", "python random", "spectral norm"],
)
def test_a_forward_that_keeps_state_replays_as_it_ran_and_trains_the_same(make_model):
    bare, _ = train_any(make_model)
    watched, snap = train_any(make_model, config={"sdc_check_interval_s": EVERY_STEP})
    assert watched == bare  # the replays put every kind of state back
    assert snap.replay_checks["not_reproduced"] == 0
    assert snap.replay_checks["reproduced"] >= 10


def test_a_layer_called_outside_the_roots_forward_is_not_compared_with_the_replay():
    make = lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # noqa: E731
    bare, _ = train_any(make, aux=True)
    watched, snap = train_any(make, aux=True, config={"sdc_check_interval_s": EVERY_STEP})
    assert watched == bare
    assert snap.replay_checks["not_reproduced"] == 0 and snap.replay_checks["reproduced"] >= 10


def test_compiled_regions_are_not_compared_with_their_reason():
    def make():
        model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
        model[1].compile(backend="aot_eager")
        return model

    _, snap = train_any(make, steps=6, config={"sdc_check_interval_s": EVERY_STEP})
    assert snap.replay_checks["not_reproduced"] == 0
    assert snap.replay_checks["not_compared"] >= 4 and snap.replay_checks["reproduced"] == 0
    assert train_any.last_refusal == COMPILED_REGIONS


def test_a_closure_optimizer_keeps_no_batch_and_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4)
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        for _ in range(8):

            def closure():
                opt.zero_grad()
                loss = model(x).sum()
                loss.backward()
                return loss

            opt.step(closure)
            prof.step()
            check = prof._events._replay_check  # nothing of a step's forward is held after it
            assert check._captured is None and check._start is None
        prof.flush()
        snap = prof.snapshot()
        reason = prof._publisher._aggregator.replay.last_refusal
    assert snap.replay_checks["not_compared"] >= 6 and reason == NOT_CAPTURED


def test_a_refused_step_sums_no_more_outputs(monkeypatch):
    """16 micro-batches: the step is refused at the second forward, and its outputs are no
    longer summed from there."""
    sums = []
    real = hooks_module.output_checksum
    monkeypatch.setattr(hooks_module, "output_checksum", lambda t: sums.append(1) or real(t))
    micro_batch_steps(4, 16)
    assert 0 < len(sums) <= 4 * 3  # (at most the first forward's 3 outputs, each step)


# ---------------- a mismatch's capsule, replayed in another process (issue 43 item 2) ----------------


def flip_in_replay(layer: str, index: tuple[int, ...] = (1, 3)):
    """The same bit flipped in `layer`'s output, but in FAULT_STEP's in-place replay (under
    no_grad) rather than in the step's own forward: the step computed right."""
    armed = {"step": False}

    def flip_once(module, args, output):
        if armed["step"] and not torch.is_grad_enabled():
            armed["step"] = False
            return flip_bit(output, index)
        return None

    def fault(model, step, x):
        if x is None:
            dict(model.named_modules())[layer].register_forward_hook(flip_once)
        armed["step"] = step == FAULT_STEP
        return x

    return fault


def with_own_witness(fault):
    """`fault`, and the test's own record of BatchNorm's running mean as FAULT_STEP's forward
    began (what the capsule must hold: the forward has changed it since)."""
    seen = {}

    def both(model, step, x):
        if step == FAULT_STEP and x is not None:
            seen["running_mean"] = model.bn.running_mean.clone()
            seen["fc1.weight"] = model.fc1.weight.detach().clone()
        return fault(model, step, x)

    return both, seen


def test_a_mismatch_writes_a_capsule_that_another_process_does_not_reproduce(tmp_path):
    """The step's own forward computed fc1 wrongly: the capsule holds the step's weights and
    BatchNorm's statistics as its forward began, both forwards' output sums; `hookprof replay`
    agrees with the in-place replay and names fc1 (exit 1)."""
    fault, seen = with_own_witness(flip_in_layer("fc1"))
    config = {"sdc_check_interval_s": EVERY_STEP, "capsule_dir": str(tmp_path)}
    _, (snap, page) = train(12, config, fault)
    mismatch = snap.replay_mismatch
    assert (mismatch.layer, mismatch.step) == ("fc1", FAULT_STEP)
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(mismatch.capsule)]
    assert snap.capsules_written == 1
    [written] = page["hookprof_capsules_written"].samples
    assert written.value == 1
    capsule = torch.load(mismatch.capsule, weights_only=True)
    assert capsule["view"]["form"] == "replay check" and capsule["view"]["step"] == FAULT_STEP
    check = capsule["check"]
    assert check["layers"][: check["first"] + 1] == ["fc1"]
    assert check["original"][0] != check["replayed"][0]
    assert check["original"][1:] != check["replayed"][1:]  # (fc1's output feeds the rest)
    model = torch.load(io.BytesIO(capsule["model"]["pickle"]), weights_only=False)
    assert torch.equal(model.bn.running_mean, seen["running_mean"])
    assert torch.equal(model.fc1.weight, seen["fc1.weight"])  # (not updated yet)

    done = replay_in_new_process(mismatch.capsule, "--runs", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith(
        "not reproduced: 2 runs on cpu agree with the in-place replay and differ from the "
        "step's own outputs first at fc1: the step's forward computed fc1 wrongly on "
    ), done.stdout


def test_a_replay_that_went_wrong_is_reproduced_elsewhere(tmp_path):
    """The in-place replay computed fc2 wrongly, the step right: the check still says
    not_reproduced (it cannot tell which of its two runs was wrong); another process gives the
    step's own bits at every layer (exit 0)."""
    config = {"sdc_check_interval_s": EVERY_STEP, "capsule_dir": str(tmp_path)}
    _, (snap, _) = train(12, config, flip_in_replay("fc2"))
    assert (snap.replay_mismatch.layer, snap.replay_mismatch.step) == ("fc2", FAULT_STEP)
    done = replay_in_new_process(snap.replay_mismatch.capsule)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        "reproduced elsewhere: 3 runs on cpu give the step's own output bits at every layer; "
        "the in-place replay, which differed first at fc2, was the odd run (suspect the "
        "machine during the replay)"
    )


def test_another_kind_of_device_gives_no_verdict(tmp_path):
    """A capsule from a CUDA step replayed on the CPU: no verdict (exit 3), the difference
    still said. (The capsule is this CPU run's, its device kind rewritten as a GPU's.)"""
    config = {"sdc_check_interval_s": EVERY_STEP, "capsule_dir": str(tmp_path)}
    _, (snap, _) = train(10, config, flip_in_layer("act"))
    path = snap.replay_mismatch.capsule
    capsule = torch.load(path, weights_only=True)
    capsule["view"]["device_type"] = "cuda"
    torch.save(capsule, path)
    done = replay_in_new_process(path, "--runs", "1")
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith(
        "no verdict: the step ran on cuda, this replay on cpu: other kernels, whose bits are "
        "not expected to match (first layer that differs from the step's outputs here: act)"
    )


def test_no_mismatch_no_capsule(tmp_path):
    config = {"sdc_check_interval_s": EVERY_STEP, "capsule_dir": str(tmp_path)}
    _, (snap, _) = train(12, config)
    assert snap.replay_checks["reproduced"] >= 10 and snap.replay_mismatch is None
    assert list(tmp_path.iterdir()) == [] and snap.capsules_written == 0


def test_a_layer_called_through_its_forward_is_summed_in_the_other_process_too(
    tmp_path, monkeypatch
):
    """`self.fc1.forward(x)`: hookprof sums its output (its hooks wrap `forward`), and so
    must `hookprof replay`, or a healthy step reads as not reproduced (found by review)."""
    monkeypatch.setattr(sys.modules[__name__], "Net", DirectForwardNet)
    config = {"sdc_check_interval_s": EVERY_STEP, "capsule_dir": str(tmp_path)}
    _, (snap, _) = train(12, config, flip_in_replay("fc2", (1, 0)))
    assert snap.replay_mismatch.layer == "fc2"
    done = replay_in_new_process(snap.replay_mismatch.capsule, "--runs", "1")
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_copy_of_the_model_once_the_capsule_count_is_reached(tmp_path, monkeypatch):
    """A failing device can make every check a mismatch: past capsule_max_count, no capsule
    and no copy of the model (the slot is taken first; found by review)."""
    from hookprof.nonfinite import capsule as capsule_module

    copies = []
    real = capsule_module.module_on_cpu
    monkeypatch.setattr(
        "hookprof.nonfinite.check_capsule.module_on_cpu",
        lambda *a, **k: copies.append(1) or real(*a, **k),
    )

    def flip_every_replay(model, step, x):
        if x is None:
            model.fc1.register_forward_hook(
                lambda m, a, out: flip_bit(out) if not torch.is_grad_enabled() else None
            )
        return x

    config = {
        "sdc_check_interval_s": EVERY_STEP,
        "capsule_dir": str(tmp_path),
        "capsule_max_count": 1,
    }
    _, (snap, _) = train(8, config, flip_every_replay)
    assert snap.replay_checks["not_reproduced"] >= 6
    assert len(list(tmp_path.iterdir())) == 1 and copies == [1]
