"""Issue 12 on the CPU: GradScaler skips of fused optimizers counted exactly, non-finite
updates held back (on_nonfinite "skip"/"raise"), and the same logic on an emulated device
that runs steps behind the host (tests/support/lagging_device.py). The cuda twins are in
tests/gpu/test_gpu_nonfinite.py."""

from __future__ import annotations

import pytest
import torch

import hookprof
from support.compare import assert_same
from support.inject import BadBatch, StepInjector
from support.lagging_device import lagging_device
from support.models import DeepNet, loss_of, scaler_loop, seeded
from support.optimizers import adam, momentum_sgd
from support.settings import EVERY_STEP, RARELY


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_gradscaler_skips_are_counted_exactly_and_are_no_incident(kind):
    """Issue 12 row 5/6: a fused optimizer is always stepped (the kernel skips through
    optimizer.found_inf), so 'the optimizer did not step' never happens; the skips must
    still equal the scaler's own count, and none of them is a backward incident."""
    model = seeded(DeepNet)
    norms: dict[int, float] = {}

    def expected_norm(step, scale):  # the unscaled gradients the update uses, computed apart
        grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        norms[step] = (torch.linalg.vector_norm(grads) / scale).item()

    overflow = {2, 3, 5, 8, 9, 10, 13, 14, 17, 19}
    prof = hookprof.attach(model, **EVERY_STEP)
    skipped = scaler_loop(model, adam(model, kind), 20, overflow, on_step=expected_norm)
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    assert skipped == len(overflow)  # the scaler's own count
    assert snap.skipped_steps == skipped
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
    assert snap.first_nonfinite is None
    assert snap.grad_norm == pytest.approx(norms[20], rel=1e-5)  # unscaled, step 20's


def test_fused_gradscaler_skipping_that_never_stops_is_an_incident():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, port=0, max_skipped_steps=3)
    scaler_loop(model, adam(model, "fused"), 8, overflow_at=set(range(2, 9)))
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    assert snap.skipped_steps == 7
    assert snap.nonfinite_steps["backward"] == 4  # skips 4 to 7 in a row are past the limit
    assert snap.first_nonfinite.layer == "(gradscaler)"


def train(
    model,
    opt,
    steps: int,
    injector=None,
    skip_update_at: frozenset = frozenset(),
    prof=None,
    stop_at: int | None = None,
) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        if injector is not None:
            injector.step = step
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, model.batch(g))
        loss.backward()
        if step == stop_at:
            return
        if step not in skip_update_at:
            opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [momentum_sgd, lambda m: adam(m, "fused"), lambda m: adam(m, "foreach")],
    ids=["sgd", "fused adam", "foreach adam"],
)
def test_skip_policy_holds_back_the_nonfinite_update_and_trains_on(make_opt):
    """A NaN made in a layer's forward at step 4: its update never reaches the weights or
    the optimizer state; training goes on exactly as a loop that skipped that one update."""
    reference = seeded(DeepNet)
    train(
        reference,
        make_opt(reference),
        9,
        StepInjector(reference.blocks[1].act, {4}),
        skip_update_at=frozenset({4}),
    )
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
    train(model, make_opt(model), 9, StepInjector(model.blocks[1].act, {4}))
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    assert_same(reference, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert snap.held_back_updates == 1
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.phase, snap.first_nonfinite.step) == (
        "blocks.1.act",
        "forward",
        4,
    )
    assert snap.nonfinite_steps["forward"] == 1  # one bad step, and only one


def test_raise_policy_stops_before_the_weights_are_hit():
    reference = seeded(DeepNet)
    ref_opt = momentum_sgd(reference)
    train(reference, ref_opt, 4, StepInjector(reference.blocks[1].act, {4}), stop_at=4)
    model = seeded(DeepNet)
    opt = momentum_sgd(model)
    prof = hookprof.attach(model, **RARELY, on_nonfinite="raise")
    try:
        with pytest.raises(hookprof.NonFiniteError) as info:
            train(model, opt, 9, StepInjector(model.blocks[1].act, {4}))
    finally:
        prof.detach()
    assert (info.value.layer, info.value.step) == ("blocks.1.act", 4)
    assert_same(reference, model)  # step 4's update never happened
    for state in opt.state.values():  # nor did it reach the momentum buffers
        assert torch.isfinite(state["momentum_buffer"]).all()


def train_with_bad_batch(model, opt, steps: int, bad_step: int, skip_update_at=frozenset()):
    bad = BadBatch(model, model.blocks[2].fc)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        inputs, target = model.batch(g)
        if step == bad_step:
            bad.poisoned = inputs
        loss = loss_of(model, (inputs, target))
        loss.backward()
        if step not in skip_update_at:
            opt.step()


@pytest.mark.parametrize("lag", [1, 3, 6])
def test_on_a_device_steps_behind_the_fused_update_is_held_back_and_the_producer_named(lag):
    """Issue 12 row 1 and requirement 6: the output flag of step 6 reaches the host `lag`
    steps later; the fused kernel skips step 6's update on the device meanwhile, the step's
    inputs are kept, and the replay names the producer when the flag arrives. The training
    thread never waits for the device."""
    reference = seeded(DeepNet)
    train_with_bad_batch(reference, adam(reference, "fused"), 12, 6, skip_update_at=frozenset({6}))
    model = seeded(DeepNet)
    with lagging_device(lag) as device:
        prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
        train_with_bad_batch(model, adam(model, "fused"), 12, 6)
        assert "MainThread" not in device.waits  # no wait on the training thread so far
        prof.flush()
        snap = prof.snapshot()
        prof.detach()
    assert_same(reference, model)
    assert snap.held_back_updates == 1
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("blocks.2.fc", "forward", 6)


def test_on_a_device_steps_behind_flush_brings_every_counter_over():
    """Issue 12 row 7: 20 steps after a NaN, no sampled step since: flush() counts it."""
    model = seeded(DeepNet)
    with lagging_device(3):
        prof = hookprof.attach(model, **RARELY)
        train(model, momentum_sgd(model), 25, StepInjector(model.blocks[0].fc, {5}))
        prof.flush()
        snap = prof.snapshot()
        prof.detach()
    assert snap.step == 25
    assert snap.nonfinite_steps["forward"] == 21  # steps 5-25: the weights are NaN from 5 on
    assert snap.nonfinite_steps["backward"] == 21
    assert snap.first_nonfinite.step == 5 and snap.first_nonfinite.phase == "forward"


def test_record_with_nonfinite_sync_names_the_producer_before_the_update_on_a_device_behind():
    """Under "record" hookprof never changes training; on a device behind the host the
    producer is then named only with the opt-in wait (nonfinite_sync), which the training
    thread does at the optimizer hook: the one wait it is allowed, because it was asked for."""
    reference = seeded(DeepNet)
    train_with_bad_batch(reference, momentum_sgd(reference), 10, 6)
    model = seeded(DeepNet)
    with lagging_device(3) as device:
        prof = hookprof.attach(model, **RARELY, nonfinite_sync=True)
        train_with_bad_batch(model, momentum_sgd(model), 10, 6)
        prof.flush()
        snap = prof.snapshot()
        prof.detach()
    for a, b in zip(reference.parameters(), model.parameters()):  # training unchanged (NaN too)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert "MainThread" in device.waits
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("blocks.2.fc", "forward", 6)
    assert snap.held_back_updates == 0


@pytest.mark.parametrize("lag", [None, 2], ids=["host flags", "device flags"])
def test_an_update_that_raises_leaves_nothing_held_back_for_the_next_step(lag):
    """The optimizer's step raised after the guard hid a bad step's gradients and set
    found_inf (no post-hook ran): the next step must neither get those stale gradients back
    nor stay skipped."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    model = seeded(DeepNet)
    opt = adam(model, "fused")
    import contextlib

    # host flags: the guard hides the gradients; device flags: it sets found_inf
    with lagging_device(lag) if lag else contextlib.nullcontext():
        prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
        bad = BadBatch(model, model.blocks[2].fc)
        g = torch.Generator().manual_seed(0)
        inputs, target = model.batch(g)
        bad.poisoned = inputs
        loss_of(model, (inputs, target)).backward()

        def fail(optimizer, args, kwargs):  # runs after hookprof's pre-hook
            raise RuntimeError("the update failed")

        handle = register_optimizer_step_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="the update failed"):
                opt.step()
        finally:
            handle.remove()
        assert hasattr(opt, "found_inf") == bool(lag)  # left behind by the failed step
        opt.zero_grad(set_to_none=True)
        inputs, target = model.batch(g)
        loss_of(model, (inputs, target)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()  # (still hookprof's step: the failed update never ended it)
        prof.detach()
    assert not hasattr(opt, "found_inf")  # the stale flag went, and this step's too
    for p, grad in zip(model.parameters(), grads):  # no stale gradient came back
        assert torch.equal(p.grad, grad)


def test_two_profilers_sharing_one_fused_optimizer_hold_back_only_the_bad_step():
    """An encoder and a decoder attached apart, one fused optimizer for both, on a device
    behind the host: each guard puts its found_inf on the optimizer in turn. The second
    must not take the first's for GradScaler's and hand it back after the step (the first's
    stale flag then held every later update back, counted as GradScaler skips, and stayed on
    the optimizer after detach())."""
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    dec = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.05, fused=True)
    bad_step, held = 3, []
    with lagging_device(3):
        profs = [hookprof.attach(m, on_nonfinite="skip", **RARELY) for m in (enc, dec)]
        try:
            g = torch.Generator().manual_seed(0)
            for step in range(1, 9):
                x = torch.randn(4, 8, generator=g)
                if step == bad_step:
                    x[0, 0] = float("nan")
                opt.zero_grad(set_to_none=True)
                before = [p.detach().clone() for p in dec.parameters()]
                dec(enc(x)).pow(2).mean().backward()
                opt.step()
                if all(torch.equal(b, p) for b, p in zip(before, dec.parameters())):
                    held.append(step)
            snaps = []
            for prof in profs:
                prof.flush()
                snaps.append(prof.snapshot())
        finally:
            for prof in profs:
                prof.detach()
    assert held == [bad_step]
    assert [s.skipped_steps for s in snaps] == [0, 0]  # no GradScaler here: nothing it skipped
    assert not hasattr(opt, "found_inf")
    before = [p.detach().clone() for p in dec.parameters()]
    opt.zero_grad()
    dec(enc(torch.randn(4, 8))).pow(2).mean().backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, dec.parameters()))


class FailsOnHeldStep(torch.optim.SGD):
    """An optimizer whose own step raises when it finds no gradient at all (what hookprof's
    guard leaves it on a held-back step): a custom optimizer that asserts its inputs."""

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if all(p.grad is None for g in self.param_groups for p in g["params"]):
            raise RuntimeError("no gradients to step on")
        super().step()
        return loss


@pytest.mark.parametrize("with_closure", [False, True], ids=["step()", "step(closure)"])
def test_a_held_back_step_that_raises_gives_the_gradients_back(with_closure):
    """Issue 29 item 10: under skip, the guard hides a non-finite step's gradients from the
    optimizer; when the optimizer's step raises (no post-hook runs), the user's .grad must
    still be there as the exception reaches the loop, equal to what backward produced."""
    import sys

    model = seeded(DeepNet, depth=2)
    opt = FailsOnHeldStep(model.parameters(), lr=0.05)
    prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
    injector = StepInjector(model.blocks[1].act, {3})
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(1, 4):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            batch = model.batch(g)

            def closure():
                loss = loss_of(model, batch)
                loss.backward()
                return loss

            if with_closure:
                if step < 3:
                    opt.step(closure)
                    continue
                with pytest.raises(RuntimeError, match="no gradients to step on"):
                    opt.step(closure)
                grads = None
            else:
                closure()
                grads = [p.grad.clone() for p in model.parameters()]
                if step < 3:
                    opt.step()
                    continue
                with pytest.raises(RuntimeError, match="no gradients to step on"):
                    opt.step()
        params = list(model.parameters())
        assert sum(p.grad is not None for p in params) == len(params)  # was 0 of 6
        if grads is not None:
            for p, grad in zip(params, grads):  # bit for bit, the NaNs where they were
                torch.testing.assert_close(p.grad, grad, rtol=0, atol=0, equal_nan=True)
        else:  # the closure's backward made them: NaN where the injected NaN went
            assert not all(torch.isfinite(p.grad).all() for p in params)
        assert sys.getprofile() is None  # the watch took itself off
    finally:
        prof.detach()
