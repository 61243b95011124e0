"""Per-layer gradients, read on the device at the step boundary: exact norms on sampled
steps, a non-finite check on every other step.

Gradients are read once they are final: at optimizer-step time (after DDP's all-reduce and
after the last micro-batch of gradient accumulation), or at an explicit `Profiler.step()`.
Nothing is read back here.

- **Sampled steps** (`GradientNorms.layer_squares`): one fused `torch._foreach_norm` per
  device gives every parameter's L2 norm; an `index_add_` folds their squares into one slot
  per layer. Its host cost grows with the number of gradients (one output tensor each: ~3 us
  apiece on an H100), which is per-layer work, and per-layer work belongs to sampled steps.
- **Every other step** (`GradientNorms.layer_checks`, nonfinite_check="all"): per layer, a
  value that is non-finite exactly when the layer's gradients hold a NaN or Inf (their sum),
  with a handful of ATen ops and output tensors whatever the number of gradients
  (DESIGN.md invariant 11; tests/unit/step/test_host_cost.py counts ops, tensors and Python
  calls): the gradients are copied into one flat buffer by one `torch._chunk_cat` (the op
  FSDP2 packs its reduce-scatter with, casting as it copies: to bfloat16 on a GPU, float32
  elsewhere, `_CHECK_DTYPE`), cut into pieces of at
  most `_PIECE` elements (so a GPU reduces them in balanced blocks, not one block per
  gradient), summed per piece by one `segment_reduce`, and the pieces folded into layers by
  one `index_add_`. The copy is made `_CHUNK_BYTES` at a time, so its memory is bounded
  whatever the model. Which gradient goes where is a cached plan, rebuilt only when the set
  of gradients changes.

  Why bfloat16 on a GPU: NaN and Inf survive the cast, and its range is float32's, so no
  float16 gradient's sum overflows (at 65504 it would) and only a finite value or piece sum
  beyond ~3.39e38 reads as non-finite (a float32 norm past 1.8e19 always has); precision
  does not matter for a check; and the device moves 2 bytes per element to the buffer and
  back, not 4. A CPU converts and sums bfloat16 ~3x slower than float32 (measured with
  bench/host_cost.py, 2026-11-27), so there the copy is float32, with the same range. The price against one read of every gradient (the floor) is that copy: ~1 extra pass
  over float32 gradients of device memory traffic, ~0.15 ms per step for GPT-124M on an
  H100 (a kernel that reduces without the copy needs code of hookprof's own on the device:
  issue 37).

On a CPU each op costs its compute, not a launch: there, one BLAS dot per gradient reads the
gradients fastest, for sampled and other steps alike (`cpu_dot_per_tensor`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import compress, count, repeat
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

# the every-step check's copy of the gradients is made this many bytes at a time: its memory
# is bounded (a 1.3B-parameter bf16 model makes 10 copies of 256 MiB, ~40 ops, on a step
# of a second or more); a model below it makes one
_CHUNK_BYTES = 256 << 20
# elements per summed piece: a GPU's segmented reduction gives each segment one thread
# block, so a 38M-element embedding gradient summed as one segment would keep one SM busy
# for milliseconds; pieces of 64K elements spread over all of them
_PIECE = 1 << 16
_GRAD = operator.attrgetter("grad")
# the check's copy and sums, by device type (see the module's docstring); float32 elsewhere
_CHECK_DTYPE = {"cuda": torch.bfloat16}
_CAN_CHUNK_CAT = hasattr(torch, "_chunk_cat")  # torch >= 2.4; before, one reshape per gradient


class _Chunk(NamedTuple):
    """Gradients `start:stop` of a check plan's order, reduced together: all of one dtype."""

    start: int
    stop: int
    numel: int  # elements of the gradients start:stop, the sum of `lengths`
    lengths: torch.Tensor  # elements of each piece, in order (on the device)
    index: torch.Tensor  # the layer of each piece (on the device)
    scalar: bool  # 0-d gradients (which _chunk_cat refuses): stacked, one piece each


class _CheckPlan(NamedTuple):
    """How one set of present gradients is checked: their order (positions in the table's
    parameters, grouped by dtype; empty gradients left out, they hold nothing non-finite),
    the chunks of that order, and the layers that have a gradient."""

    device: torch.device
    dtype: torch.dtype  # of the first gradient in `order`: a cheap per-step validity check
    check_dtype: torch.dtype  # of the copy, the sums and the per-layer values (_CHECK_DTYPE)
    order: tuple[int, ...]
    chunks: tuple[_Chunk, ...]
    seen: frozenset[int]


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
        self._check_plans: dict[tuple[int, ...], _CheckPlan | None] = {}  # None: no fused check
        self._n = len(table)

    def layer_checks(self) -> tuple[list[torch.Tensor], frozenset[int]]:
        """Per device: per layer, a value (bfloat16 on a GPU, float32 elsewhere) that is
        non-finite exactly when the layer's
        gradients hold a NaN or Inf (the sum of its gradients; a finite value or sum past
        ~3.39e38 also reads as non-finite, as a norm past 1.8e19 does in `layer_squares`);
        and the layers that had any gradient. Same shape as
        `layer_squares`, fewer ops: see the module's docstring. Falls back to
        `layer_squares` where the fused check does not apply (a CPU with
        `cpu_dot_per_tensor`, gradients on several devices, sparse or DTensor ones)."""
        if self._distributed:
            return self._grouped()
        grads = list(map(_GRAD, self._params))  # C-level: no Python call per gradient
        missing: tuple[int, ...] = ()
        if not all(map(operator.is_not, grads, repeat(None))):
            missing = tuple(compress(count(), map(operator.is_, grads, repeat(None))))
        plan = self._check_plans.get(missing, False)
        if plan is False or (plan is not None and (grads[plan.order[0]].device != plan.device
                                                   or grads[plan.order[0]].dtype != plan.dtype)):
            plan = self._make_check_plan(grads, missing)  # new, or the model was moved or cast
        if plan is None:
            return self.layer_squares()
        try:
            return [self._checked(plan, grads)], plan.seen
        except RuntimeError:  # a gradient changed shape or dtype alone: plan again, once
            plan = self._make_check_plan(grads, missing)
            if plan is None:
                return self.layer_squares()
            return [self._checked(plan, grads)], plan.seen

    def _checked(self, plan: _CheckPlan, grads: list[torch.Tensor | None]) -> torch.Tensor:
        ordered = list(map(grads.__getitem__, plan.order))
        dtype = plan.check_dtype
        out = torch.zeros(self._n, dtype=dtype, device=plan.device)
        for chunk in plan.chunks:  # one chunk below _CHUNK_BYTES of one dtype: the usual case
            part = ordered[chunk.start:chunk.stop]
            if chunk.scalar:
                out.index_add_(0, chunk.index, torch.stack(part).to(dtype))
                continue
            if _CAN_CHUNK_CAT:
                flat = torch.empty((1, chunk.numel), dtype=dtype, device=plan.device)
                torch._chunk_cat(part, 0, 1, out=flat)  # (resized, with a warning, when a size changed)
            else:
                flat = torch.cat([g.reshape(-1) for g in part]).to(dtype)[None]
            if flat.numel() != chunk.numel:  # a gradient changed shape: its pieces with it
                raise RuntimeError("the gradients' sizes changed since the plan")
            # unsafe: the lengths are ours, and their total is checked above; the safe mode
            # reads their sum and minimum back to the host, two waits for the device
            sums = torch.segment_reduce(flat[0], "sum", lengths=chunk.lengths, unsafe=True)
            out.index_add_(0, chunk.index, sums)
        return out

    def _make_check_plan(self, grads: list[torch.Tensor | None],
                         missing: tuple[int, ...]) -> _CheckPlan | None:
        present = [i for i, g in enumerate(grads) if g is not None]
        if len(self._check_plans) >= _MAX_PLANS:
            self._check_plans.clear()
        self._check_plans[missing] = None
        if not present:
            return None
        devices = {grads[i].device for i in present}
        if len(devices) != 1 or any(grads[i].is_sparse for i in present):
            return None
        (device,) = devices
        if device.type == "cpu" and self.cpu_dot_per_tensor:
            return None
        layer = self._table.param_layer
        nonempty = [i for i in present if grads[i].numel()]
        dtypes = list(dict.fromkeys(grads[i].dtype for i in nonempty))  # first seen, first
        order: list[int] = []
        chunks: list[_Chunk] = []
        for dtype in dtypes:
            for scalar in (False, True):
                group = [i for i in nonempty if grads[i].dtype == dtype and (grads[i].dim() == 0) == scalar]
                for run in _runs_within(group, grads, _CHUNK_BYTES):
                    lengths: list[int] = []
                    owners: list[int] = []
                    for i in run:
                        n = grads[i].numel()
                        pieces = [_PIECE] * (n // _PIECE) + ([n % _PIECE] if n % _PIECE else [])
                        lengths += pieces
                        owners += [layer[i]] * len(pieces)
                    start = len(order)
                    order += run
                    chunks.append(_Chunk(start, len(order), sum(lengths), index_to_device(lengths, device),
                                         self._index(device, owners), scalar))
        if not order:
            return None
        plan = _CheckPlan(device, grads[order[0]].dtype, _CHECK_DTYPE.get(device.type, torch.float32),
                          tuple(order), tuple(chunks), frozenset(layer[i] for i in present))
        self._check_plans[missing] = plan
        return plan

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


def _runs_within(positions: list[int], grads: list[Any], budget: int) -> list[list[int]]:
    """`positions` cut into consecutive runs of at most `budget` bytes of gradient each (a
    gradient larger than that is a run of its own)."""
    runs: list[list[int]] = []
    size = budget
    for i in positions:
        nbytes = grads[i].numel() * grads[i].element_size()
        if size + nbytes > budget:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += nbytes
    return runs


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

    __slots__ = ("_norms", "squares", "exact")

    def __init__(self, norms: GradientNorms):
        self._norms = norms
        # (per-device squares, the layers that had a gradient), or None: not read this step;
        # not `exact`: per-layer values to check for NaN/Inf only, not norms
        self.squares: tuple[list[torch.Tensor], frozenset[int]] | None = None
        self.exact = True

    def read_once(self, wanted: bool, exact: bool = True) -> None:
        """Read them now if this step wants them (sampled, or nonfinite_check="all") and
        they were not read yet: with `exact`, per-layer squared norms (a sampled step's
        figures); without, per-layer values that are only checked for NaN/Inf (every other
        step: GradientNorms.layer_checks, a constant handful of ops)."""
        if self.squares is None and wanted:
            self.squares = self._norms.layer_squares() if exact else self._norms.layer_checks()
            self.exact = exact

    def forget(self) -> None:
        """A new step, or a closure that ran another backward: read again when next needed."""
        self.squares = None

    def unscale(self, view: Any) -> None:
        """A fused optimizer's GradScaler step (guard.ScalerView): norms of the unscaled
        gradients, as the update sees them."""
        if view is not None and self.squares is not None and self.exact:
            self.squares = (view.unscale(self.squares[0]), self.squares[1])


def no_gradients_notice(model_type: str) -> str:
    """Said once when a step that ran its forward ends with no gradient to read."""
    return (f"no parameter of {model_type} had a gradient at the end of a step that ran its "
            "forward, so gradient norms and the per-layer backward check have nothing to read: "
            "end steps after the backward and before zero_grad() (prof.step() there, or a "
            "torch.optim step); gradients computed functionally (torch.func) are not in .grad")
