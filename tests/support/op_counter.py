"""Counting what a piece of code costs the host, for the host cost tests
(unit/step/test_host_cost.py, the guard's, the GPU's) and bench/host_cost.py: the ATen ops it
issues (each one a kernel launch on a GPU), the tensors they return, and the Python calls
into hookprof's files; per training step, and hookprof's share of an unsampled step."""

from __future__ import annotations

import copy
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hookprof
from support.models import DeepNet, loss_of, seeded
from support.settings import RARELY


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched on this thread while active (by overload name), and
    the tensors they return (a foreach op with N outputs counts N: each is a tensor object
    made on the host, ~3 us apiece on a GPU); keeps the keyword arguments of the ops named
    in `keep_kwargs`."""

    def __init__(self, keep_kwargs: tuple[str, ...] = ("aten.segment_reduce.default",)) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.outputs = 0
        self._keep = keep_kwargs
        self.kwargs_of: dict[str, list[dict]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if name in self._keep:
            self.kwargs_of.setdefault(name, []).append(dict(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self.outputs += sum(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
        return out


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


_PACKAGE = os.path.dirname(hookprof.__file__) + os.sep


class CallCounter:
    """Python calls into hookprof's own files on this thread while active (`sys.setprofile`
    "call" events, by file:function; a comprehension or a generator counts once per call, a
    C function not at all)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(_PACKAGE):
                self.calls[f"{path[len(_PACKAGE) :]}:{frame.f_code.co_name}"] += 1

    def __enter__(self) -> CallCounter:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)


@dataclass
class HostCost:
    """hookprof's share of one unsampled step: ATen ops by name, the tensors they returned,
    Python calls into hookprof by file:function."""

    ops: Counter = field(default_factory=Counter)
    tensors: int = 0
    calls: Counter = field(default_factory=Counter)

    def totals(self) -> tuple[int, int, int]:
        return sum(self.ops.values()), self.tensors, sum(self.calls.values())


@contextmanager
def _accelerator_path(lag: int | None, gradients: bool) -> Iterator[None]:
    """With `gradients`, the gradient reduction and, with `lag`, every flag as on a device
    `lag` steps behind (support/lagging_device.py): what a GPU's host runs, on the CPU."""
    from hookprof.step.gradients import GradientNorms
    from support.lagging_device import lagging_device

    saved = GradientNorms.cpu_dot_per_tensor
    GradientNorms.cpu_dot_per_tensor = not gradients
    try:
        if lag is None:
            yield
        else:
            with lagging_device(lag):
                yield
    finally:
        GradientNorms.cpu_dot_per_tensor = saved


def host_cost_of_unsampled_step(
    depth: int,
    *,
    device: str = "cpu",
    lag: int | None = 3,
    cpu_path: bool = False,
    warmup: int = 3,
    **config,
) -> HostCost:
    """hookprof's ops, tensors and Python calls in one unsampled step of DeepNet(depth) on
    `device`, with the defaults and `config`: with it, less without it (two copies of one
    model, same batch). On the CPU, the accelerator's path (`lag`: the emulated device's
    lag; None: flags on the host, as a CPU reads them; `cpu_path`: the CPU's own gradient
    reduction instead); on CUDA, the real one (`lag` must be None)."""
    base = seeded(DeepNet, depth=depth).to(device)
    batch = tuple(t.to(device) for t in base.batch(torch.Generator().manual_seed(0)))
    bare, watched = base, copy.deepcopy(base)
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.0)  # lr 0: every step is the same step
    watched_opt = torch.optim.SGD(watched.parameters(), lr=0.0)
    with _accelerator_path(lag, gradients=not cpu_path):
        prof = hookprof.attach(watched, **{**RARELY, **config})
        try:
            for _ in range(warmup):  # step 1 is sampled; step 2 builds the cached plans
                one_step(bare, bare_opt, batch)
                one_step(watched, watched_opt, batch, prof)
            with OpCounter() as counter, CallCounter() as calls:
                one_step(watched, watched_opt, batch, prof)
            with OpCounter() as bare_counter:
                one_step(bare, bare_opt, batch)
            assert prof.snapshot().sampled_steps <= 1  # the counted step was not sampled
        finally:
            prof.detach()
    assert not (bare_counter.ops - counter.ops), "hookprof removed ops from the training step?"
    return HostCost(
        counter.ops - bare_counter.ops, counter.outputs - bare_counter.outputs, calls.calls
    )
