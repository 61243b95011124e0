"""Per-layer gradient norms, computed on the device at the step boundary.

Gradients are read once they are final: at optimizer-step time (after DDP's all-reduce and
after the last micro-batch of gradient accumulation), or at an explicit `Profiler.step()`.
One fused `torch._foreach_norm` per device gives every parameter's L2 norm; an `index_add_`
folds their squares into one slot per layer. Nothing is read back here: a norm is non-finite
exactly when its gradient holds a NaN or Inf, so the host learns both from the same numbers.
"""

from __future__ import annotations

import torch

from .layers import LayerTable
from .transfer import index_to_device


def local_tensor(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this rank holds: a DTensor's local shard, a sparse gradient's
    values. Norms of these are partial; combining them across ranks is left to PromQL."""
    if grad.is_sparse:
        return grad.coalesce().values()
    to_local = getattr(grad, "to_local", None)  # DTensor, without importing torch.distributed
    return to_local() if to_local is not None else grad


class GradientNorms:
    def __init__(self, table: LayerTable):
        self._table = table
        self._index_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        # DTensor parameters (FSDP2, tensor parallel) have DTensor gradients: known at attach,
        # so plain models skip the per-gradient lookup (this loop runs every step)
        self._distributed = table.has_dtensor_params

    def layer_squares(self) -> tuple[list[torch.Tensor], frozenset[int]]:
        """Per device: (squared L2 norm of each layer's gradients over that device's
        parameters, float64 of length len(table)); and the layers that had any gradient."""
        groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        distributed = self._distributed
        for p, layer in zip(self._table.params, self._table.param_layer):
            grad = p.grad
            if grad is None:
                continue
            if distributed or grad.is_sparse:
                grad = local_tensor(grad)
            grads, layers = groups.setdefault(grad.device, ([], []))
            grads.append(grad)
            layers.append(layer)
        return layer_squares(groups, len(self._table), self._index_cache)


def layer_squares(groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]], n: int,
                  index_cache: dict) -> tuple[list[torch.Tensor], frozenset[int]]:
    """Tensors grouped by device with the layer of each: per device, the squared L2 norms
    summed per layer (float64, length n, on the device); and the layers seen. Nothing is
    read back. `index_cache` keeps the host-to-device layer indices between calls."""
    out = []
    seen: set[int] = set()
    for device, (tensors, layers) in groups.items():
        squares = _squared_norms(device, tensors)
        key = (device, tuple(layers))
        index = index_cache.get(key)
        if index is None:
            index = index_cache[key] = index_to_device(layers, device)
        per_layer = torch.zeros(n, dtype=torch.float64, device=device)
        per_layer.index_add_(0, index, squares)
        out.append(per_layer)
        seen.update(layers)
    return out, frozenset(seen)


_BLAS_DTYPES = (torch.float32, torch.float64)


def _squared_norms(device: torch.device, grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each gradient, float64, on `device`."""
    if device.type == "cpu":
        # on the CPU a BLAS dot product reads a gradient ~3x faster than the norm kernels
        # (measured: 1.2 ms vs 3.5 ms for 6.3M float32 values on 2 cores)
        squares = []
        for g in grads:
            if g.dtype in _BLAS_DTYPES:
                flat = g.reshape(-1)
                squares.append(torch.dot(flat, flat))
            else:
                squares.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
        return torch.stack(squares).to(torch.float64)
    # one fused kernel launch for all of a device's gradients; float32 accumulation so that
    # an fp16 gradient whose norm exceeds 65504 is not an overflow
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).to(torch.float64).square()
