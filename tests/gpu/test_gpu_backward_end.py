"""Issue 38 on a real GPU: the every-step gradient check at the backward's end, whose
callback autograd may run on its CUDA device thread while the training thread waits in
backward(). A NaN-norm clip after the backward must not move the first layer, eager and
compiled, on a device that runs behind the host; the backward NaN's capsule is kept under
nonfinite_sync. Marked cuda (skipped without CUDA). Written, not yet run on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from unit.step.test_backward_end import model_and_data

import hookprof
from hookprof.nonfinite import reproduce
from support.settings import RARELY

pytestmark = pytest.mark.cuda


def first(prof):
    prof.flush()
    e = prof.snapshot().first_nonfinite
    return None if e is None else (e.layer, e.phase, e.step)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_clip_by_a_nan_norm_on_cuda_names_the_first_gradient(compiled):
    model, batches = model_and_data(bad_at=3)
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    call = torch.compile(model) if compiled else model
    try:
        for x, y in batches[:6]:
            opt.zero_grad()
            nn.functional.mse_loss(call(x.cuda()), y.cuda()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
        assert first(prof) == ("blocks.3.fc", "backward", 3)
        assert prof.snapshot().internal_errors == 0
    finally:
        prof.detach()


def test_a_backward_nan_capsule_on_cuda_under_nonfinite_sync(tmp_path):
    from hookprof import _testing

    _testing.forget_capsules_written()
    torch.manual_seed(0)
    model = (
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        .cuda()
        .half()
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    prof = hookprof.attach(
        model,
        config=hookprof.Config(
            summary_at_exit=False, capsule_dir=str(tmp_path), nonfinite_sync=True, **RARELY
        ),
    )
    try:
        for _ in range(4):
            x, y = (
                torch.randn(32, 16, generator=g).half().cuda(),
                torch.randn(32, 1, generator=g).cuda(),
            )
            opt.zero_grad()
            (nn.functional.mse_loss(model(x).float(), y) * 1024.0).backward()
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    finally:
        prof.detach()
    assert event is not None and event.phase == "backward" and event.capsule is not None
    lines = []
    assert reproduce.replay(event.capsule, device="cuda", say=lines.append) == reproduce.REPRODUCED
    assert lines[0].endswith(f"(layer {event.layer})"), lines
