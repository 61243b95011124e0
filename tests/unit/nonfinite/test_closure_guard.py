"""Issue 12, closure steps: under on_nonfinite "skip" and "raise" a non-finite update is held
back also when the step's forward and backward run inside `optimizer.step(closure)`
(torch.optim.LBFGS, a hand-written sharpness-aware optimizer, Lightning's automatic
optimization, any optimizer given a closure). The optimizer's step pre-hook runs before the
closure has made the step's gradients, so the guard acts when each call of the closure
returns (hookprof wraps the closure for that one step).

Every reference is computed without hookprof: a loop that skips the bad update itself
(its closure drops the gradients of a non-finite evaluation, as a careful user would write
it, or it never steps at all), or a run that stopped before the bad step."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hookprof
from support.closures import OPTIMIZERS, closure_loop
from support.compare import assert_same, finite
from support.inject import BadBatch, StepInjector
from support.lagging_device import lagging_device
from support.metrics import parse, samples, scrape
from support.models import DeepNet, loss_of, seeded
from support.settings import RARELY

BAD_STEP = 4


class DelegatingSAM(torch.optim.Optimizer):
    """SAM as davda54/sam writes it (the most used implementation): the first forward and
    backward run before `step(closure)`, the closure makes the second, and the update is an
    inner optimizer's (`base_optimizer`). Its own code keys on `p.grad is None` both to
    climb and to come back down."""

    def __init__(self, params, rho: float = 0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure):
        norm = torch.norm(
            torch.stack(
                [
                    p.grad.norm(p=2)
                    for g in self.param_groups
                    for p in g["params"]
                    if p.grad is not None
                ]
            ),
            p=2,
        )
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * (g["rho"] / (norm + 1e-12)))
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


def delegating_sam_loop(model, steps: int, injector, skip_steps=frozenset()):
    opt = DelegatingSAM(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        injector.step = step
        batch = model.batch(g)
        if step in skip_steps:
            continue
        loss_of(model, batch).backward()
        opt.step(lambda batch=batch: loss_of(model, batch).backward())
    return opt


def test_skip_holds_back_a_closure_optimizer_that_delegates_its_update():
    """Judged when the closure returns, davda54's SAM would find no gradient where it comes
    back down from its climb and keep the climbed (NaN) weights: its update is its inner
    optimizer's, judged at that optimizer's pre-hook."""
    reference = seeded(DeepNet)
    ref_opt = delegating_sam_loop(
        reference,
        8,
        StepInjector(reference.blocks[1].act, {BAD_STEP}),
        skip_steps=frozenset({BAD_STEP}),
    )
    model = seeded(DeepNet)
    with hookprof.attach(model, **RARELY, on_nonfinite="skip") as prof:
        opt = delegating_sam_loop(model, 8, StepInjector(model.blocks[1].act, {BAD_STEP}))
        prof.flush()
        snap = prof.snapshot()
    assert_same(reference, model)
    assert_same_state(ref_opt.base_optimizer, opt.base_optimizer)
    assert snap.held_back_updates == 1 and snap.step == 8
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.step) == ("blocks.1.act", BAD_STEP)


def flat_state(opt) -> dict:
    """Every value of the optimizer's state, tensors in lists flattened out, by a stable key."""
    out = {}
    for i, state in enumerate(opt.state.values()):
        for key, value in state.items():
            if isinstance(value, list):
                for j, v in enumerate(value):
                    out[(i, key, j)] = v
            else:
                out[(i, key)] = value
    return out


def assert_same_state(a_opt, b_opt) -> None:
    a, b = flat_state(a_opt), flat_state(b_opt)
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_skip_holds_back_a_closure_step_whose_forward_went_nonfinite(kind):
    """A NaN made in blocks.1.act at step 4, in every evaluation of that step: the update
    of step 4 never reaches the parameters or the optimizer state, and training goes on
    bit for bit as a loop whose closure dropped that step's gradients itself (for SAM, also
    as a loop that never stepped at step 4)."""
    make = OPTIMIZERS[kind]
    reference = seeded(DeepNet)
    ref_opt = make(reference)
    closure_loop(
        reference,
        ref_opt,
        9,
        StepInjector(reference.blocks[1].act, {(BAD_STEP, c) for c in range(1, 100)}),
        hide_nonfinite=True,
    )
    assert finite(reference.parameters())

    model = seeded(DeepNet)
    opt = make(model)
    attrs = set(vars(opt))
    prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
    returned = closure_loop(
        model, opt, 9, StepInjector(model.blocks[1].act, {(BAD_STEP, c) for c in range(1, 100)})
    )
    prof.flush()
    snap = prof.snapshot()
    prof.detach()

    assert_same(reference, model)
    assert_same_state(ref_opt, opt)
    assert finite(model.parameters()) and finite(flat_state(opt).values())
    assert snap.held_back_updates == 1
    assert snap.nonfinite_steps["forward"] == 1
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("blocks.1.act", "forward", BAD_STEP)
    # the wrapped closure changed nothing the optimizer returns, and nothing was left behind
    assert all(out is first for first, out in returned)
    assert set(vars(opt)) == attrs

    if kind == "sam":  # the same as never stepping at step 4
        never = seeded(DeepNet)
        never_opt = make(never)
        closure_loop(never, never_opt, 9, skip_steps=frozenset({BAD_STEP}))
        assert_same(never, model)
        assert_same_state(never_opt, opt)


# (with line_search_fn="strong_wolfe" every evaluation after the first is inside torch's
# line search, which cannot take a NaN loss without a gradient: _strong_wolfe fails with an
# IndexError, also in the reference that drops the gradients itself; see docs/nonfinite.md)
@pytest.mark.parametrize("kind", ["lbfgs"])
def test_skip_holds_back_a_later_lbfgs_evaluation_that_went_nonfinite(kind):
    """LBFGS evaluates the closure several times per step. Here the first evaluations of
    step 4 are finite and the third is not: its gradients never reach LBFGS (it sees no
    gradient, so it ends its step there), the moves made from finite evaluations stay, and
    LBFGS's history (d, t, prev_flat_grad, old_dirs, ...) holds no NaN."""
    make = OPTIMIZERS[kind]
    reference = seeded(DeepNet)
    ref_opt = make(reference)
    closure_loop(
        reference,
        ref_opt,
        8,
        StepInjector(reference.blocks[1].act, {(BAD_STEP, 3)}),
        hide_nonfinite=True,
    )

    model = seeded(DeepNet)
    opt = make(model)
    prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
    closure_loop(model, opt, 8, StepInjector(model.blocks[1].act, {(BAD_STEP, 3)}))
    prof.flush()
    snap = prof.snapshot()
    prof.detach()

    assert_same(reference, model)
    assert_same_state(ref_opt, opt)
    assert finite(model.parameters()) and finite(flat_state(opt).values())
    assert snap.held_back_updates == 1
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.step) == ("blocks.1.act", BAD_STEP)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_raise_stops_a_closure_step_before_its_update(kind):
    make = OPTIMIZERS[kind]
    reference = seeded(DeepNet)
    ref_opt = make(reference)
    closure_loop(reference, ref_opt, 9, stop_before=BAD_STEP)

    model = seeded(DeepNet)
    opt = make(model)
    prof = hookprof.attach(model, **RARELY, on_nonfinite="raise")
    try:
        with pytest.raises(hookprof.NonFiniteError) as info:
            closure_loop(
                model,
                opt,
                9,
                StepInjector(model.blocks[1].act, {(BAD_STEP, c) for c in range(1, 100)}),
            )
    finally:
        prof.detach()
    assert (info.value.layer, info.value.phase, info.value.step) == (
        "blocks.1.act",
        "forward",
        BAD_STEP,
    )
    assert_same(reference, model)  # step 4's update never happened
    assert finite(flat_state(opt).values())
    state, ref_state = flat_state(opt), flat_state(ref_opt)
    if kind.startswith("lbfgs"):  # the held-back step counted its one evaluation, nothing else
        func_evals = (0, "func_evals")
        assert state.pop(func_evals) == ref_state.pop(func_evals) + 1
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        if value is None:  # LBFGS's unused history slots
            assert ref_state[key] is None, key
        else:
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ref_state[key])), key


def test_skip_with_a_closure_that_returns_none_and_one_that_raises():
    """A closure may return nothing (SGD then returns None) or raise. A closure that raises
    after a non-finite forward: the exception reaches the caller unchanged, no update is
    made, and the step stays open (no post-hook ran), so the loop's next call of
    opt.step is still that bad step's and is held back; the one after it updates, with
    the gradients its own closure made."""
    reference = seeded(DeepNet)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    closure_loop(
        reference,
        ref_opt,
        9,
        StepInjector(reference.blocks[1].act, {(BAD_STEP, 1)}),
        hide_nonfinite=True,
        closure_returns_loss=False,
    )

    model = seeded(DeepNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with hookprof.attach(model, **RARELY, on_nonfinite="skip") as prof:
        closure_steps_that_return_none_or_raise(model, opt, reference, ref_opt, prof)
    assert not hasattr(opt, "found_inf")


def closure_steps_that_return_none_or_raise(model, opt, reference, ref_opt, prof):
    returned = closure_loop(
        model,
        opt,
        9,
        StepInjector(model.blocks[1].act, {(BAD_STEP, 1)}),
        closure_returns_loss=False,
    )
    assert all(out is None for _, out in returned)
    assert_same(reference, model)
    assert_same_state(ref_opt, opt)

    batch = model.batch(torch.Generator().manual_seed(1))
    injector = StepInjector(model.blocks[1].act, {"raising"})

    def failing():
        injector.step = "raising"
        opt.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        raise ValueError("the closure failed")

    def good():
        injector.step = None
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        made.append([p.grad.clone() for p in model.parameters()])
        return loss

    made: list[list[torch.Tensor]] = []
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="the closure failed"):
        opt.step(failing)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step(good)  # still the bad step: held back
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step(good)  # a new, finite step: it updates
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert finite(model.parameters())
    for p, grad in zip(model.parameters(), made[-1]):  # put back as the closure made them
        assert torch.equal(p.grad, grad)
    prof.flush()
    assert prof.snapshot().held_back_updates == 2


def fused_closure_loop(model, steps: int, bad_step: int, skip_steps=frozenset()):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    bad = BadBatch(model, model.blocks[2].fc)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        inputs, target = model.batch(g)
        if step == bad_step:
            bad.poisoned = inputs
        if step in skip_steps:
            continue

        def closure(inputs=inputs, target=target):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, (inputs, target))
            loss.backward()
            return loss

        opt.step(closure)
    return opt


@pytest.mark.parametrize("lag", [1, 3])
def test_on_a_device_steps_behind_a_fused_closure_step_is_held_back_on_the_device(lag):
    """Fused Adam takes a closure (it calls it before reading optimizer.found_inf): the
    flag of the closure's evaluation, still on the (emulated) device, goes to the kernel,
    the training thread never waits, and the late replay names the producer."""
    reference = seeded(DeepNet)
    fused_closure_loop(reference, 10, 6, skip_steps=frozenset({6}))
    model = seeded(DeepNet)
    with lagging_device(lag) as device:
        prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
        opt = fused_closure_loop(model, 10, 6)
        assert "MainThread" not in device.waits
        prof.flush()
        snap = prof.snapshot()
        prof.detach()
    assert_same(reference, model)
    assert not hasattr(opt, "found_inf")
    assert snap.held_back_updates == 1
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("blocks.2.fc", "forward", 6)


lightning = None
with contextlib.suppress(ImportError):
    import lightning  # noqa: F811


@pytest.mark.skipif(lightning is None, reason="Lightning is a test extra (pip install -e '.[dev]')")
@pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated",
)
def test_lightning_automatic_optimization_skip_holds_back_step_7(tmp_path):
    """Lightning always passes a closure. A NaN made in body.3 at step 7 under "skip":
    training goes on to step 12 with finite weights, bit for bit as a run whose
    on_before_optimizer_step dropped step 7's gradients, and one held-back update is on
    the /metrics page."""
    from support.inject import NanAt
    from support.lightning_models import Regressor, SetStep, fit

    class DropsGradientsAt(Regressor):  # the reference skips step 7's update itself
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            if self.trainer.global_step + 1 == 7:
                for p in self.parameters():
                    p.grad = None

    ref_nan = NanAt({7})
    torch.manual_seed(0)
    reference = DropsGradientsAt(middle=ref_nan)
    fit(reference, 12, callbacks=[SetStep(ref_nan)], root_dir=tmp_path)
    assert finite(reference.parameters())

    nan = NanAt({7})
    torch.manual_seed(0)
    model = Regressor(middle=nan)
    prof = hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, on_nonfinite="skip"
    )
    try:
        trainer = fit(model, 12, callbacks=[SetStep(nan)], root_dir=tmp_path)
        prof.flush()
        page = parse(scrape(prof.url))
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert trainer.global_step == 12 and snap.step == 12
    assert finite(model.parameters())
    assert_same(reference, model)
    assert samples(page, "hookprof_held_back_updates", "hookprof_held_back_updates_total") == {
        frozenset({("rank", "0")}): 1.0
    }
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("body.3", "forward", 7)


@pytest.mark.parametrize("sync", [False, True], ids=["no wait", "nonfinite_sync"])
def test_on_a_device_steps_behind_a_non_fused_closure_step_needs_the_opt_in_wait(sync):
    """LBFGS has no found_inf to skip on the device: with the flag still on the (emulated)
    device, its update is held back only with nonfinite_sync=True, which waits on the
    training thread, as asked; without it, hookprof says once that it is not held back."""
    make = OPTIMIZERS["lbfgs"]
    bad = {(BAD_STEP, c) for c in range(1, 100)}
    reference = seeded(DeepNet)
    closure_loop(
        reference,
        make(reference),
        7,
        StepInjector(reference.blocks[1].act, bad),
        hide_nonfinite=sync,
    )
    model = seeded(DeepNet)
    with lagging_device(2) as device:
        with hookprof.attach(model, **RARELY, on_nonfinite="skip", nonfinite_sync=sync) as prof:
            closure_loop(model, make(model), 7, StepInjector(model.blocks[1].act, bad))
            prof.flush()
            snap = prof.snapshot()
    for a, b in zip(reference.parameters(), model.parameters()):  # NaN where the reference has it
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert finite(model.parameters()) == sync
    assert ("MainThread" in device.waits) == sync
    assert snap.held_back_updates == (1 if sync else 0)
    assert any("LBFGS is not fused" in n for n in snap.notices) != sync


def gpu_closure_run(model, opt, steps: int, bad) -> None:
    """test_gpu_nonfinite's loop with the forward and backward in a closure, under
    set_sync_debug_mode("error"): a sync that hookprof added raises."""
    from support.cuda import BAD_STEP as GPU_BAD_STEP
    from support.cuda import no_sync

    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(32, 64, device="cuda", generator=g) for _ in range(steps)]
    ys = [torch.randn(32, 1, device="cuda", generator=g) for _ in range(steps)]
    torch.cuda.synchronize()
    with no_sync():
        for step, (x, y) in enumerate(zip(xs, ys), 1):
            if step == GPU_BAD_STEP:
                bad.poisoned = x

            def closure(x=x, y=y):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_cuda_fused_closure_step_is_held_back_on_the_device_without_a_sync(policy):
    """On a real GPU, fused AdamW given a closure: the bad step's flag goes to the kernel
    through found_inf, set when the closure returns; the producer is named once the flag
    arrives, with intact weights, and no sync is added."""
    from support.cuda import BAD_STEP as GPU_BAD_STEP
    from support.cuda import setup

    model, opt = setup(fused=True)
    bad = BadBatch(model, model.blocks[3][1])
    prof = hookprof.attach(model, **RARELY, on_nonfinite=policy)
    try:
        if policy == "raise":
            with pytest.raises(hookprof.NonFiniteError) as info:
                gpu_closure_run(model, opt, 40, bad)
            assert (info.value.layer, info.value.step) == ("blocks.3.1", GPU_BAD_STEP)
        else:
            gpu_closure_run(model, opt, 40, bad)
            prof.flush()
            snap = prof.snapshot()
            assert snap.held_back_updates == 1
            event = snap.first_nonfinite
            assert (event.layer, event.phase, event.step) == ("blocks.3.1", "forward", GPU_BAD_STEP)
    finally:
        prof.detach()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not hasattr(opt, "found_inf")
