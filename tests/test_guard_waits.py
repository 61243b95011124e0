"""The opt-in wait (`nonfinite_sync=True`) and the guard's bookkeeping, on a device that runs
steps behind the host (tests/lagging_device.py): what the training thread waits for, and
what the update guard and the forward replay keep between steps."""

from __future__ import annotations

import pytest
import torch

import hookprof
from lagging_device import lagging_device
from models import DeepNet, loss_of, seeded
from test_update_guard import BadBatch, momentum_sgd

RARELY = dict(port=0, sample_every=1000, min_sample_interval_s=3600.0)  # step 1 only
BAD_STEP = 6


def train_counting_waits(model, opt, device, steps: int, per_step: list[int]) -> None:
    """Train `steps` steps (step BAD_STEP's batch makes a NaN in blocks.2.fc's forward);
    appends to `per_step` how many times the training thread waited for the device in each."""
    bad = BadBatch(model, model.blocks[2].fc)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        before = device.waits.count("MainThread")
        opt.zero_grad(set_to_none=True)
        inputs, target = model.batch(g)
        if step == BAD_STEP:
            bad.poisoned = inputs
        loss_of(model, (inputs, target)).backward()
        try:
            opt.step()
        finally:
            per_step.append(device.waits.count("MainThread") - before)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_sync_waits_once_per_step_with_a_non_fused_optimizer(policy):
    """A non-fused optimizer under skip/raise with nonfinite_sync: the replay's output flag
    and the guard's step flag are both needed before the update; only one of them may block
    (the other is then on the host already: it was copied earlier on the same stream)."""
    model = seeded(DeepNet)
    opt = momentum_sgd(model)
    with lagging_device(3) as device:
        prof = hookprof.attach(model, **RARELY, on_nonfinite=policy, nonfinite_sync=True)
        waits: list[int] = []
        try:
            if policy == "raise":
                # raised once the drained counters are published (up to publish_interval_s
                # later on a device behind the host): maybe not within these few steps
                try:
                    train_counting_waits(model, opt, device, 10, waits)
                except hookprof.NonFiniteError as exc:
                    assert (exc.layer, exc.step) == ("blocks.2.fc", BAD_STEP)
                assert len(waits) >= BAD_STEP
                assert waits == [1] * len(waits), str(waits)
            else:
                train_counting_waits(model, opt, device, 10, waits)
                assert waits == [1] * 10, str(waits)
                prof.flush()
                snap = prof.snapshot()
                assert snap.held_back_updates == 1
                event = snap.first_nonfinite
                assert (event.layer, event.phase, event.step) == ("blocks.2.fc", "forward", BAD_STEP)
        finally:
            prof.detach()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_whether_a_closure_optimizer_delegates_is_worked_out_once_and_held_weakly(monkeypatch):
    """The guard asks on every closure step whether the optimizer hands its update to an
    inner one (walking its attributes): once per optimizer, again only when its attributes
    change (an inner optimizer set later), and without keeping the optimizer alive."""
    import gc
    import weakref

    import hookprof.guard
    import hookprof.profiler
    from test_closure_guard import OPTIMIZERS, closure_loop

    answers: list[bool] = []
    original = hookprof.guard.delegates_update

    def counted(optimizer):
        answers.append(original(optimizer))
        return answers[-1]

    for module in (hookprof.guard, hookprof.profiler):  # wherever it is looked up from
        monkeypatch.setattr(module, "delegates_update", counted, raising=False)
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sam"](model)
    with hookprof.attach(model, **RARELY, on_nonfinite="skip") as prof:
        closure_loop(model, opt, 5)
        assert answers == [False]  # 5 closure steps, worked out once
        opt.inner = torch.optim.SGD(model.parameters(), lr=0.0)  # an attribute added later
        closure_loop(model, opt, 2)
        assert answers == [False, True]
        dropped = weakref.ref(opt)
        del opt
        gc.collect()
        assert dropped() is None  # the profiler, still attached, does not keep it
        assert prof.snapshot() is not None
