"""Issue 41 on a real GPU: every step's loss and global gradient norm reach the history,
written into the device ring without a host-device sync, equal to the test's own per-step
values, in float32 and in fp16 with a GradScaler and a fused optimizer (whose gradients the
norm reads still scaled: the ring's value is unscaled). Marked cuda (skipped without CUDA).
Written, not yet run on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import hookprof
from support.cuda import no_sync, setup
from support.settings import RARELY

pytestmark = pytest.mark.cuda

STEPS = 40


def _own_norm(model) -> float:
    return math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )


@pytest.mark.parametrize("fp16", [False, True], ids=["float32", "fp16-gradscaler-fused"])
def test_every_step_on_cuda_equals_the_loops_own_values_without_a_sync(fp16):
    model, opt = setup(fused=True)
    scaler = torch.amp.GradScaler("cuda") if fp16 else None
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (
            torch.randn(32, 64, device="cuda", generator=g),
            torch.randn(32, 1, device="cuda", generator=g),
        )
        for _ in range(STEPS)
    ]
    seen = {}
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    try:
        for step, (x, y) in enumerate(batches, start=1):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scale = float(scaler.get_scale())  # (a sync of the test's own, before the step)
                norm = _own_norm(model) / scale
                with no_sync():
                    scaler.step(opt)
                scaler.update()
                if float(scaler.get_scale()) < scale:  # it skipped this step for an overflow
                    norm = None
            else:
                loss.backward()
                norm = _own_norm(model)
                with no_sync():
                    opt.step()
            with no_sync():
                prof.step(loss)
            seen[step] = (float(loss), norm)
        prof.flush()
        every = prof.report_document()["history"]["every_step"]
    finally:
        prof.detach()
    full = every["full"]
    assert full["step"] == [float(s) for s in range(1, STEPS + 1)]
    assert every["incident"] is None  # an overflow the scaler skipped is no divergence
    for s, loss, norm in zip(range(1, STEPS + 1), full["loss"], full["grad_norm"]):
        assert loss == pytest.approx(seen[s][0], rel=1e-6), s
        if seen[s][1] is None:
            assert norm is None, s  # a skipped step's norm is no value
        else:
            assert norm == pytest.approx(seen[s][1], rel=1e-3), s
