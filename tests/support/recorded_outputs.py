"""Training a small model while hooks of the test's own keep each child module's outputs of
the last step, every call of it: what per-layer statistics are checked against."""

from __future__ import annotations

import torch
from torch import nn


def train_recording_calls(model: nn.Module, steps: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Train `steps` SGD steps on batches of 8 x 6 (a generator seeded with `seed`); return
    each child's outputs of the last step, in call order."""
    calls: dict[str, list[torch.Tensor]] = {}

    def keep(out: torch.Tensor, name: str) -> None:
        calls.setdefault(name, []).append(out.detach().clone())

    handles = [
        m.register_forward_hook(lambda m, a, out, name=name: keep(out, name))
        for name, m in model.named_children()
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(steps):
            calls.clear()
            loss = model(torch.randn(8, 6, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def profiled_run(
    model: nn.Module, steps: int, seed: int, **attach: object
) -> tuple[dict[str, list[torch.Tensor]], object, str]:
    """hookprof attached with `attach`, `steps` steps trained as above, flushed: (each
    child's outputs of the last step, the snapshot, the /metrics page); detached after."""
    import hookprof
    from support.metrics import scrape

    prof = hookprof.attach(model, **attach)
    try:
        calls = train_recording_calls(model, steps, seed)
        prof.flush()
        return calls, prof.snapshot(), scrape(prof.url)
    finally:
        prof.detach()
