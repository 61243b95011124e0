"""The update replay's tests' own loop parts (tests/behaviour/test_update_replay.py and
test_update_capsule.py): the armed configuration, the model, and a fault of the test's own in
the kernel that writes an optimizer's update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookprof.tensors import local_bits
from support.jumps import layer_ratios

AT = 140  # the jump's step (a layer's ratio is judged from 20 of its measurements on)
STEPS = 160
# every step sampled, measuring every layer's update (no turns), the spike replay armed
ARMED = dict(
    port=0,
    sample_every=1,
    min_sample_interval_s=0.0,
    update_norm_interval_s=0.0,
    update_norm_max_bytes=2**30,
    summary_at_exit=False,
    spike_replay=True,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def faulty(kernel: str, step: int, weight: torch.Tensor, flip) -> Callable[..., Any]:
    """torch.Tensor's in-place `kernel`, made to run `flip` on `weight`'s bits after it
    writes `weight` on step `step()` (once): a device's wrong result of one update's kernel.
    The second run of the update writes its own copy of `weight`, which it leaves alone."""
    real = getattr(torch.Tensor, kernel)
    done = []

    def run(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if self is weight and step() == AT and not done:
            done.append(True)
            with torch.no_grad():
                flip(local_bits(self))
        return result

    return run


def flip_row(bits: torch.Tensor) -> None:
    bits[3] ^= 1 << 22  # a mantissa bit of each element of row 3


def regression_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    prof,
    steps: int,
    lr_times: Callable[[int, int], float],
    *,
    batch: int = 32,
    outputs: int = 4,
    before_step: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """`steps` steps of a regression on random inputs of 16 features (the model's first
    `outputs` of them as targets), each param group's learning rate `lr_times(step, group)`
    times its own, `prof.step()` after each; returns every step's ratios of the model's
    Linear layers, from this loop's own copies around the update."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    base = [group["lr"] for group in opt.param_groups]
    g = torch.Generator().manual_seed(0)
    ratios: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        for k, group in enumerate(opt.param_groups):
            group["lr"] = base[k] * lr_times(step, k)
        if before_step is not None:
            before_step(step)
        x = torch.randn(batch, 16, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :outputs]).backward()
        before = {n: [p.detach().clone() for p in m.parameters()] for n, m in layers.items()}
        opt.step()
        ratios.append(layer_ratios(layers, before))
        prof.step()
    return ratios
