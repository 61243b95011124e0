"""Issue 31 on a real GPU: a capsule written on CUDA replays on CUDA and on the CPU, and the
two verdicts agree. Marked cuda (skipped without CUDA; `python -m pytest -m cuda`). Written,
not yet run on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from support.capsules import replay_in_new_process

pytestmark = pytest.mark.cuda
BAD_STEP = 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capsule_replays_on_cuda_and_on_the_cpu_with_the_same_verdict(tmp_path):
    _testing.forget_capsules_written()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # nonfinite_sync: the replay runs before the update, on the bad forward's own weights
    config = hookprof.Config(
        summary_at_exit=False,
        capsule_dir=str(tmp_path),
        nonfinite_sync=True,
        port=0,
        sample_every=1000,
        min_sample_interval_s=3600.0,
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    with hookprof.attach(model, config=config) as prof:
        for step in range(1, BAD_STEP + 3):
            x = torch.randn(32, 64, device="cuda", generator=g)
            if step == BAD_STEP:
                x[0] = 3e38 * torch.sign(model[0].weight[0].detach())
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert event is not None and event.layer == "0" and event.capsule is not None
    view = torch.load(event.capsule, weights_only=True)["view"]
    assert view["device"].startswith("GPU-") and view["device_uuid"] == view["device"]
    on_cuda, on_cpu = (
        replay_in_new_process(event.capsule, "--device", "cuda"),
        replay_in_new_process(event.capsule, "--device", "cpu"),
    )
    assert on_cuda.returncode == on_cpu.returncode == 0, on_cuda.stdout + on_cpu.stdout
    assert on_cuda.stdout.splitlines()[0] == on_cpu.stdout.splitlines()[0]
    assert on_cuda.stdout.splitlines()[0].startswith("reproduced: NaN/Inf made by 0 (")
