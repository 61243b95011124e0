"""Issue 43 on a real GPU: an update ratio jump's capsule (nonfinite/update_capsule.py) written
on CUDA replays on CUDA as reproduced, and on the CPU as no verdict (other kernels); a fused
AdamW with a tensor learning rate on the device (capturable) carries it back there. Training
is bit for bit what it is without hookprof. Marked cuda (skipped without CUDA;
`python -m pytest -m cuda`). Written, not yet run on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from support.capsules import replay_in_new_process
from support.updates import ARMED, AT, STEPS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW fused, capturable, tensor lr": lambda ps: torch.optim.AdamW(
        ps, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True
    ),
}


def train(make_opt, config=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    opt = make_opt(model.parameters())
    g = torch.Generator(device="cuda").manual_seed(0)
    prof = hookprof.attach(model, **config) if config is not None else None
    try:
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                lr = 1e-3 * (40.0 if step == AT else 1.0)
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            x = torch.randn(64, 64, device="cuda", generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :8]).backward()
            opt.step()
            if prof is not None:
                prof.step()
        params = [p.detach().clone() for p in model.parameters()]
        if prof is None:
            return params, None
        prof.flush()
        return params, prof.snapshot()
    finally:
        if prof is not None:
            prof.detach()


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_cuda_jumps_capsule_replays_on_cuda_and_says_no_verdict_on_the_cpu(tmp_path, make_opt):
    bare, _ = train(make_opt)
    watched, snap = train(make_opt, {**ARMED, "capsule_dir": str(tmp_path)})
    assert all(torch.equal(a, b) for a, b in zip(bare, watched))
    jump = snap.spikes["update_ratio_jump"].first
    assert (jump.step, jump.verdict) == (AT, "reproduced")
    view = torch.load(jump.capsule, weights_only=True)["view"]
    assert view["form"] == "update" and view["device_type"] == "cuda"
    on_cuda = replay_in_new_process(jump.capsule, "--device", "cuda")
    assert on_cuda.returncode == 0, on_cuda.stdout + on_cuda.stderr
    assert on_cuda.stdout.startswith("reproduced: 3 runs on cuda")
    on_cpu = replay_in_new_process(jump.capsule, "--device", "cpu")
    assert on_cpu.returncode in (3, 2), on_cpu.stdout + on_cpu.stderr
