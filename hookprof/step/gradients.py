"""Per-layer gradient norms, computed on the device at the step boundary.

Gradients are read once they are final: at optimizer-step time (after DDP's all-reduce and
after the last micro-batch of gradient accumulation), or at an explicit `Profiler.step()`.
One fused `torch._foreach_norm` per device gives every parameter's L2 norm; an `index_add_`
folds their squares into one slot per layer. Nothing is read back here: a norm is non-finite
exactly when its gradient holds a NaN or Inf, so the host learns both from the same numbers.

This runs on every step (nonfinite_check="all"), so on an accelerator its host work must not
grow with the model: a fixed number of ATen ops per step whatever the number of parameters
(tests/unit/step/test_host_cost.py counts them), and the Python around them a list of `.grad`s plus
a cached plan (which layer each gradient belongs to, the index tensor on the device) that is
rebuilt only when the set of parameters holding a gradient changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hookprof.layers import LayerTable
from hookprof.device.transfer import index_to_device


def local_tensor(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this rank holds: a DTensor's local shard, a sparse gradient's
    values. Norms of these are partial; combining them across ranks is left to PromQL."""
    if grad.is_sparse:
        return grad.coalesce().values()
    to_local = getattr(grad, "to_local", None)  # DTensor, without importing torch.distributed
    return to_local() if to_local is not None else grad


class _Plan(NamedTuple):
    """How to reduce one set of present gradients: all on `device`, dense, so one fused
    pass serves (None: the general path, grouping by device per step)."""

    device: torch.device | None
    index: torch.Tensor | None  # layer of each present gradient, on `device`
    seen: frozenset[int]  # layers that have a gradient


_MAX_PLANS = 8  # sets of present gradients remembered (freezing layers in turn makes a few)


class GradientNorms:
    # on the CPU a BLAS dot product per gradient reads ~3x faster than the norm kernels
    # (measured: 1.2 ms vs 3.5 ms for 6.3M float32 values on 2 cores), and a CPU op costs
    # its compute, not a launch; tests set this False to drive the accelerator path on a CPU
    cpu_dot_per_tensor = True

    def __init__(self, table: LayerTable):
        self._table = table
        self._params = table.params
        self._index_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        # keyed by the positions of the parameters without a gradient (usually ()): the one
        # thing that changes the plan from step to step
        self._plans: dict[tuple[int, ...], _Plan] = {}
        # DTensor parameters (FSDP2, tensor parallel) have DTensor gradients: known at attach,
        # so plain models skip the per-gradient lookup (this loop runs every step)
        self._distributed = table.has_dtensor_params

    def layer_squares(self) -> tuple[list[torch.Tensor], frozenset[int]]:
        """Per device: (squared L2 norm of each layer's gradients over that device's
        parameters, float64 of length len(table)); and the layers that had any gradient."""
        if self._distributed:
            return self._grouped()
        grads = [p.grad for p in self._params]
        missing = tuple(i for i, g in enumerate(grads) if g is None)
        if missing:
            grads = [g for g in grads if g is not None]
            if not grads:
                return [], frozenset()
        plan = self._plans.get(missing)
        # one device check per step: a model moved with .to() after attach gets a new plan
        if plan is None or (plan.device is not None and grads[0].device != plan.device):
            plan = self._make_plan(grads, missing)
        if plan.device is None:
            return self._grouped()
        if plan.device.type == "cpu" and self.cpu_dot_per_tensor:
            squares = _cpu_squared_norms(grads)
            per_layer = torch.zeros(len(self._table), dtype=torch.float64)
            return [per_layer.index_add_(0, plan.index, squares)], plan.seen
        return [fused_layer_squares(grads, plan.index, len(self._table))], plan.seen

    def _make_plan(self, grads: list[torch.Tensor], missing: tuple[int, ...]) -> _Plan:
        absent = set(missing)
        layers = [layer for i, layer in enumerate(self._table.param_layer) if i not in absent]
        devices = {g.device for g in grads}
        if len(devices) != 1 or any(g.is_sparse for g in grads):
            plan = _Plan(None, None, frozenset(layers))
        else:
            (device,) = devices
            plan = _Plan(device, self._index(device, layers), frozenset(layers))
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[missing] = plan
        return plan

    def _index(self, device: torch.device, layers: list[int]) -> torch.Tensor:
        key = (device, tuple(layers))
        index = self._index_cache.get(key)
        if index is None:
            if len(self._index_cache) >= _MAX_PLANS:
                self._index_cache.clear()
            index = self._index_cache[key] = index_to_device(layers, device)
        return index

    def _grouped(self) -> tuple[list[torch.Tensor], frozenset[int]]:
        """The general path: gradients on several devices, sparse ones, DTensor shards.
        Grouped per device on every step (Python per parameter)."""
        groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        distributed = self._distributed
        for p, layer in zip(self._params, self._table.param_layer):
            grad = p.grad
            if grad is None:
                continue
            if distributed or grad.is_sparse:
                grad = local_tensor(grad)
            grads, layers = groups.setdefault(grad.device, ([], []))
            grads.append(grad)
            layers.append(layer)
        return layer_squares(groups, len(self._table), self._index, cpu_dot=self.cpu_dot_per_tensor)


_BLAS_DTYPES = (torch.float32, torch.float64)


def fused_layer_squares(grads: list[torch.Tensor], index: torch.Tensor, n: int) -> torch.Tensor:
    """Per-layer squared L2 norms (float64, length n) of `grads`, all on one device, where
    `index[k]` is the layer of `grads[k]`: five ATen ops whatever len(grads) is. One fused
    kernel launch reads every gradient, with float32 accumulation so that an fp16 gradient
    whose norm exceeds 65504 is not an overflow; squares in float64 so that a float32 norm
    near its maximum does not square to inf."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    squares = torch.stack(norms).to(torch.float64).square()
    return torch.zeros(n, dtype=torch.float64, device=index.device).index_add_(0, index, squares)


def _cpu_squared_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each CPU gradient, float64: one BLAS dot each."""
    squares = []
    for g in grads:
        if g.dtype in _BLAS_DTYPES:
            flat = g.reshape(-1)
            squares.append(torch.dot(flat, flat))
        else:
            squares.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
    return torch.stack(squares).to(torch.float64)


def layer_squares(groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]], n: int,
                  index_cache: dict | Callable[[torch.device, list[int]], torch.Tensor], *,
                  cpu_dot: bool = True) -> tuple[list[torch.Tensor], frozenset[int]]:
    """Tensors grouped by device with the layer of each: per device, the squared L2 norms
    summed per layer (float64, length n, on the device); and the layers seen. Nothing is
    read back. `index_cache` keeps the host-to-device layer indices between calls (a dict,
    or a function that looks them up). Used by GradientNorms' general path and by the
    update norms (updates.py)."""
    out = []
    seen: set[int] = set()
    for device, (tensors, layers) in groups.items():
        if callable(index_cache):
            index = index_cache(device, layers)
        else:
            key = (device, tuple(layers))
            index = index_cache.get(key)
            if index is None:
                index = index_cache[key] = index_to_device(layers, device)
        if device.type == "cpu" and cpu_dot:
            per_layer = torch.zeros(n, dtype=torch.float64)
            out.append(per_layer.index_add_(0, index, _cpu_squared_norms(tensors)))
        else:
            out.append(fused_layer_squares(tensors, index, n))
        seen.update(layers)
    return out, frozenset(seen)


class StepGradients:
    """This step's per-layer gradient squares: read at most once per step, where the update
    reads the gradients (the optimizer's pre-hook, or the step's end when none ran); read
    again after an optimizer closure ran another backward; unscaled once when a fused
    optimizer's GradScaler step is seen. Owned by the profiler; the training thread only."""

    __slots__ = ("_norms", "squares")

    def __init__(self, norms: GradientNorms):
        self._norms = norms
        # (per-device squares, the layers that had a gradient), or None: not read this step
        self.squares: tuple[list[torch.Tensor], frozenset[int]] | None = None

    def read_once(self, wanted: bool) -> None:
        """Read them now if this step wants them (sampled, or nonfinite_check="all") and
        they were not read yet."""
        if self.squares is None and wanted:
            self.squares = self._norms.layer_squares()

    def forget(self) -> None:
        """A new step, or a closure that ran another backward: read again when next needed."""
        self.squares = None

    def unscale(self, view: Any) -> None:
        """A fused optimizer's GradScaler step (guard.ScalerView): norms of the unscaled
        gradients, as the update sees them."""
        if view is not None and self.squares is not None:
            self.squares = (view.unscale(self.squares[0]), self.squares[1])


def no_gradients_notice(model_type: str) -> str:
    """Said once when a step that ran its forward ends with no gradient to read."""
    return (f"no parameter of {model_type} had a gradient at the end of a step that ran its "
            "forward, so gradient norms and the per-layer backward check have nothing to read: "
            "end steps after the backward and before zero_grad() (prof.step() there, or a "
            "torch.optim step); gradients computed functionally (torch.func) are not in .grad")
