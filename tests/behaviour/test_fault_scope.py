"""DESIGN.md invariant 3: a fault disables only the smallest piece that failed, for that
call, and is retried; step counting, gradient reading and NaN detection are never switched
off by a fault elsewhere (issue 29, item 5: one vmap(grad(...)) call over the model)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import hookprof
from hookprof.device.timing import CpuTimer
from support.settings import EVERY_STEP

NAN_STEPS = {7, 8, 9}  # of steps 6..10, after the per-sample gradients
# the NaN steps' updates are held back, so the weights (and the last step's norm) stay finite
SETTINGS = dict(EVERY_STEP, serve=False, on_nonfinite="skip")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _train_step(model, opt, x, y, step: int) -> list[torch.Tensor]:
    """One step; a NaN in the first layer's weight gradient on NAN_STEPS. Returns the
    gradients the update read (copies, taken apart from hookprof)."""
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    if step in NAN_STEPS:
        with torch.no_grad():
            model[0].weight.grad[0, 0] = float("nan")
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    return grads


def _per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The common per-sample-gradient pattern: vmap(grad(...)) over functional_call."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p, xi, yi):
        out = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.mse_loss(out, yi.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss_of), in_dims=(None, 0, 0))(params, x, y)


def _forward_calls(snap) -> int:
    return sum(layer.forward_calls_total for layer in snap.layers.values())


def _setup():
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return model, x, y, torch.optim.SGD(model.parameters(), lr=0.01)


def _train_watching(prof, model, opt, x, y, steps: range, before=lambda step: None):
    """Train `steps`; returns the last step's gradients and the layer calls recorded so far
    after each step (flushed: current)."""
    seen = []
    for step in steps:
        before(step)
        grads = _train_step(model, opt, x, y, step)
        prof.flush()
        seen.append(_forward_calls(prof.snapshot()))
    return grads, seen


def _assert_core_kept(snap, grads) -> None:
    """Steps counted, the last step's global gradient norm (computed apart from hookprof)
    exported, every NaN step's gradient seen."""
    assert snap.step == 10
    truth = torch.linalg.vector_norm(torch.cat([gr.double().flatten() for gr in grads])).item()
    assert abs(snap.grad_norm - truth) <= 1e-5 * truth
    assert snap.nonfinite_steps["backward"] == len(NAN_STEPS)


def test_vmap_grad_over_an_attached_model_leaves_gradients_and_nan_checks_on(caplog):
    model, x, y, opt = _setup()
    prof = hookprof.attach(model, **SETTINGS)
    try:
        with caplog.at_level(logging.ERROR, logger="hookprof"):
            for step in range(1, 6):
                _train_step(model, opt, x, y, step)
            per_sample = _per_sample_grads(model, x, y)
            prof.flush()
            calls_before = _forward_calls(prof.snapshot())
            grads, seen = _train_watching(prof, model, opt, x, y, range(6, 11))
        snap = prof.snapshot()
    finally:
        prof.detach()

    assert per_sample["0.weight"].shape == (8, 16, 6)  # the transform itself worked
    _assert_core_kept(snap, grads)
    # every later step is sampled (EVERY_STEP): each records 3 layer calls more
    assert seen == [calls_before + 3 * k for k in range(1, 6)]
    assert snap.internal_errors == 0, caplog.text  # hookprof stepped aside under vmap


def test_a_fault_in_the_layer_hooks_costs_that_step_only(caplog):
    """A fault in the per-layer hooks turns them off for the rest of its step, and they are
    tried again at the next step; gradients and NaN checks never stop."""
    model, x, y, opt = _setup()
    failing = {"left": 0}  # failures still to inject

    class FailingTimer(CpuTimer):
        def __init__(self):
            super().__init__()
            self._clock, self.mark = self.mark, self._mark

        def _mark(self):
            if failing["left"]:  # the first clock read of step 5: in its first layer's call
                failing["left"] -= 1
                raise RuntimeError("injected layer hook failure")
            return self._clock()

    prof = hookprof.Profiler(model, hookprof.Config(**SETTINGS), timer=FailingTimer())
    try:
        with caplog.at_level(logging.ERROR, logger="hookprof"):
            grads, seen = _train_watching(
                prof,
                model,
                opt,
                x,
                y,
                range(1, 11),
                before=lambda step: failing.update(left=int(step == 5)),
            )
        snap = prof.snapshot()
    finally:
        prof.detach()

    assert snap.internal_errors == 1 and "injected layer hook failure" in caplog.text
    _assert_core_kept(snap, grads)
    # steps 1-4 record 3 calls each, step 5 (the fault) none, steps 6-10 3 each again
    assert seen == [3, 6, 9, 12, 12, 15, 18, 21, 24, 27]
