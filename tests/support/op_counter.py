"""Counting the ATen ops a piece of code issues (each one a kernel launch on a GPU), for the
host cost tests (unit/step/test_host_cost.py, the guard's, the GPU's) and bench/host_cost.py:
per training step, and hookprof's share of an unsampled step."""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hookprof
from support.models import DeepNet, loss_of, seeded
from support.settings import RARELY


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched on this thread while active (by overload name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def one_step(model, opt, batch, prof=None) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    if prof is not None:
        prof.step(loss)
    return loss


def counted_step(model, opt, batch, prof=None) -> Counter[str]:
    with OpCounter() as counter:
        one_step(model, opt, batch, prof)
    return counter.ops


def hookprof_ops_per_unsampled_step(depth: int, warmup: int = 3, device: str = "cpu") -> Counter[str]:
    """The ATen ops of one unsampled step with hookprof attached, less those of the same step
    without it (two copies of one model, same batch)."""
    base = seeded(DeepNet, depth=depth).to(device)
    batch = tuple(t.to(device) for t in base.batch(torch.Generator().manual_seed(0)))
    bare, watched = base, copy.deepcopy(base)
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.0)  # lr 0: every step is the same step
    watched_opt = torch.optim.SGD(watched.parameters(), lr=0.0)
    prof = hookprof.attach(watched, **RARELY)
    try:
        for _ in range(warmup):  # step 1 is sampled; step 2 builds the cached plan
            one_step(bare, bare_opt, batch)
            one_step(watched, watched_opt, batch, prof)
        with_ops = counted_step(watched, watched_opt, batch, prof)
        without_ops = counted_step(bare, bare_opt, batch)
        assert prof.snapshot().sampled_steps <= 1  # the counted step was not sampled
    finally:
        prof.detach()
    assert not (without_ops - with_ops), "hookprof removed ops from the training step?"
    return with_ops - without_ops
