"""Per-layer gradients, read on the device at the step boundary: exact norms on sampled
steps, a non-finite check on every other step.

Gradients are read where the update reads them: at optimizer-step time (after DDP's
all-reduce and after the last micro-batch of gradient accumulation), or at an explicit
`Profiler.step()`; and checked for NaN/Inf once more at the end of each backward
(backward_end.py), before a clip can rewrite them, for which layer went first
(StepGradients). Nothing is read back here.

- **Sampled steps** (`GradientNorms.layer_squares`): one fused `torch._foreach_norm` per
  device gives every parameter's L2 norm; an `index_add_` folds their squares into one slot
  per layer. Its host cost grows with the number of gradients (one output tensor each: ~3 us
  apiece on an H100), which is per-layer work, and per-layer work belongs to sampled steps.
- **Every other step** (`GradientNorms.layer_checks`, nonfinite_check="all"): per layer, a
  value that is non-finite exactly when the layer's gradients hold a NaN or Inf (their sum),
  with a handful of ATen ops and output tensors whatever the number of gradients
  (DESIGN.md invariant 11; tests/unit/step/test_host_cost.py counts ops, tensors and Python
  calls): the gradients are copied into one flat buffer by one `torch._chunk_cat` (the op
  FSDP2 packs its reduce-scatter with; on CUDA one kernel launch for contiguous gradients
  copied in their own dtype, which is why the copy keeps their dtype), cut into pieces of at
  most `_PIECE` elements (so a GPU reduces them in balanced blocks, not one block per
  gradient), summed per piece by one `segment_reduce`, and the pieces folded into layers by
  a second one (their lengths: each layer's count of pieces; an `index_add_` per chunk when
  a plan has several). The copy is made `_CHUNK_BYTES` at a time, and a gradient that large is
  summed where it lies, so the copy's memory is bounded whatever the model. Float16 copies
  become `x - x` first (0 or NaN: their sum would overflow at 65504). Gradients that are not
  contiguous (channels_last convolutions) would cost the copy one launch each: they get one
  `torch._foreach_norm`, one output each. Which gradient goes where is a cached plan, rebuilt
  only when the set of gradients, the device or the dtype changes (`_Chunk` has the kinds).

  The price against one read of every gradient (the floor) is the copy: ~two more passes
  over the copied gradients' bytes of device memory traffic (~0.3 ms per step for GPT-124M's
  500 MB of float32 gradients on an H100, against a 26 ms device step; unmeasured). A kernel
  that reduces without the copy needs code of hookprof's own on the device (issue 37).

On a CPU each op costs its compute, not a launch: there, one BLAS dot per gradient reads the
gradients fastest, for sampled and other steps alike (`cpu_dot_per_tensor`); tests switch it
off to run the accelerator's path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import compress, count, repeat
from typing import Any, NamedTuple

import torch

from hookprof.device import transfer
from hookprof.device.transfer import index_to_device
from hookprof.layers import LayerTable
from hookprof.step.series import StepSeries, norm_into


def local_tensor(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this rank holds: a DTensor's local shard, a sparse gradient's
    values; a complex gradient as its real view (same norm, same finiteness: the norm
    kernels refuse a float dtype for complex input). Norms of shards are partial; combining
    them across ranks is left to PromQL."""
    if grad.is_sparse:
        return grad.coalesce().values()
    if grad.is_complex():
        return torch.view_as_real(grad)
    to_local = getattr(grad, "to_local", None)  # DTensor, without importing torch.distributed
    return to_local() if to_local is not None else grad


class Reading(NamedTuple):
    """One reading of a step's gradients: per device, one tensor of per-layer values
    (squared L2 norms, or values only checked for NaN/Inf: StepGradients.exact), and the
    layers that had any gradient."""

    parts: list[torch.Tensor]
    seen: frozenset[int]


class _Plan(NamedTuple):
    """How to reduce one set of present gradients: all on `device`, dense, so one fused
    pass serves (None: the general path, grouping by device per step)."""

    device: torch.device | None
    layer_index: torch.Tensor | None  # layer of each present gradient, on `device`
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
# where the fused check runs: segment_reduce has CPU and CUDA kernels only (not MPS, say)
_FUSED_DEVICES = ("cuda", "cpu")
_CAN_CHUNK_CAT = hasattr(torch, "_chunk_cat")  # torch >= 2.4; before, one reshape per gradient


class _Chunk(NamedTuple):
    """Gradients `start:stop` of a check plan's order, reduced together, all of one dtype;
    how depends on `kind`:

    - "cat": contiguous gradients, copied into one flat buffer of their own dtype by one
      `_chunk_cat` (its CUDA kernel is one launch only for contiguous inputs copied without a
      cast), at most _CHUNK_BYTES of them;
    - "view": one contiguous gradient of _CHUNK_BYTES or more, reduced where it lies (a
      view, no copy: an embedding's gradient is not copied whole every step);
    - "strided": gradients that are not contiguous (a channels_last convolution's), whose
      copy would be one launch each: one `_foreach_norm` over them, one output each (the
      one case where the host's work grows with the model: with those gradients only);
    - "scalar": 0-d gradients (which _chunk_cat refuses): stacked, one piece each.
    """

    start: int
    stop: int
    kind: str
    numel: int  # elements of the gradients start:stop, the sum of `lengths`
    lengths: torch.Tensor | None  # elements of each summed piece, in order (on the device)
    layer_index: torch.Tensor  # the layer of each piece (on the device)
    narrow_range: bool  # float16: a finite sum overflows at 65504, so x - x (0 or NaN) first
    # pieces per layer, for every layer of the table (0 where it has none), when the pieces
    # come in layer order: the only chunk of a plan folds into layers by a second
    # `segment_reduce` (one op) instead of `zeros` and `index_add_` (two); None otherwise
    layer_pieces: torch.Tensor | None = None


class _CheckPlan(NamedTuple):
    """How one set of present gradients is checked: their order (positions in the table's
    parameters, grouped by dtype and kind; empty gradients left out, they hold nothing
    non-finite), the chunks of that order (None: no fused check here, `layer_squares`
    instead), and the layers that have a gradient. The first gradient of `order` is looked
    at every step (device and dtype): a model moved or cast gets a new plan."""

    device: torch.device | None
    dtype: torch.dtype | None
    order: tuple[int, ...]
    chunks: tuple[_Chunk, ...] | None
    seen: frozenset[int]


def _per_layer(owners: list[int], n: int) -> list[int]:
    """How many of `owners` (a layer each) each of `n` layers has."""
    counts = [0] * n
    for layer in owners:
        counts[layer] += 1
    return counts


def _pieces(n: int) -> list[int]:
    """`n` elements cut into pieces of at most _PIECE."""
    return [_PIECE] * (n // _PIECE) + ([n % _PIECE] if n % _PIECE else [])


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
        # DTensor parameters (FSDP2, tensor parallel) have DTensor gradients, complex ones
        # complex gradients (read as real views, issue 39): known at attach, so plain models
        # skip the per-gradient lookup of the general path (this loop runs every step)
        self._distributed = table.has_dtensor_params or any(p.is_complex() for p in self._params)
        self._check_plans: dict[tuple[int, ...], _CheckPlan] = {}
        self._n = len(table)
        # where the update reading writes each step's global norm (step/series.py); None:
        # not kept (a GradientNorms of the update norms, or of a test)
        self.series: StepSeries | None = None

    def layer_checks(self, norm: bool = False) -> Reading:
        """Per device: per layer, a float32 value that is non-finite exactly when the layer's
        gradients hold a NaN or Inf (the sum of its gradients, or its squared norm for
        strided ones; a finite value or sum past float32's range, ~3.4e38, also reads as
        non-finite, as a norm past 1.8e19 does in `layer_squares`); and the layers that had
        any gradient. Same shape as `layer_squares`, fewer ops: see the module's docstring.
        Falls back to `layer_squares` where the fused check does not apply (a CPU with
        `cpu_dot_per_tensor`, a device other than CUDA, gradients on several devices,
        sparse or DTensor ones). With `norm`, the global gradient norm is also written into
        the step's slot of `series` (step/series.py), from the values already read."""
        if self._distributed:
            return self.normed(self._grouped(), norm)
        grads = list(map(_GRAD, self._params))  # C-level: no Python call per gradient
        missing: tuple[int, ...] = ()
        if not all(map(operator.is_not, grads, repeat(None))):
            missing = tuple(compress(count(), map(operator.is_, grads, repeat(None))))
        plan = self._check_plans.get(missing)
        if plan is None or (
            plan.order
            and (
                grads[plan.order[0]].device != plan.device
                or grads[plan.order[0]].dtype != plan.dtype
            )
        ):
            plan = self._make_check_plan(grads, missing)  # new, or the model was moved or cast
        for again in (False, True):  # a gradient changed shape alone: plan again, once
            if plan.chunks is None:
                return self.normed(self.layer_squares(), norm)
            try:
                # (one method, not a helper per attempt: a Python call less, twice a step)
                ordered = list(map(grads.__getitem__, plan.order))
                chunks = plan.chunks
                # one chunk in layer order (the usual model): its pieces fold into layers by
                # one segment_reduce; else zeros, and one index_add_ per chunk
                fold = chunks[0].layer_pieces if len(chunks) == 1 else None
                out = (
                    torch.zeros(self._n, dtype=torch.float32, device=plan.device)
                    if fold is None
                    else None
                )
                read: list[torch.Tensor] = []  # what the norm is taken over (norm)
                for chunk in chunks:  # one "cat" chunk: the usual model
                    part = ordered[chunk.start : chunk.stop]
                    kind = chunk.kind
                    if kind == "scalar":
                        values = torch.stack(part)
                        read.append(values)
                    elif kind == "strided":
                        values = torch.stack(torch._foreach_norm(part, 2, dtype=torch.float32))
                        read.append(values)  # (their norms: the norm of norms is theirs)
                    else:
                        if kind == "view":
                            flat = part[0].view(-1)  # the user's gradient: read, never written
                            read.append(flat)
                            if chunk.narrow_range:
                                flat = flat.sub(flat)
                        else:
                            flat = (
                                torch._chunk_cat(part, 0, 1)[0]
                                if _CAN_CHUNK_CAT
                                else torch.cat([g.reshape(-1) for g in part])
                            )
                            if chunk.narrow_range:
                                if norm:  # before the copy becomes 0 or NaN
                                    read.append(torch.linalg.vector_norm(flat, dtype=torch.float64))
                                flat.sub_(flat)  # our own copy: 0 where finite, NaN where not
                            else:
                                read.append(flat)
                        if flat.numel() != chunk.numel:  # a gradient changed shape
                            raise RuntimeError("the gradients' sizes changed since the plan")
                        # unsafe: the lengths are ours, and their total is checked above; the
                        # safe mode reads their sum and minimum back to the host, two waits
                        values = torch.segment_reduce(
                            flat, "sum", lengths=chunk.lengths, unsafe=True
                        )
                    if fold is not None:
                        out = torch.segment_reduce(values, "sum", lengths=fold, unsafe=True)
                        if out.dtype != torch.float32:
                            out = out.float()
                    else:
                        assert out is not None
                        out.index_add_(
                            0,
                            chunk.layer_index,
                            values if values.dtype == torch.float32 else values.float(),
                        )
                if norm and self.series is not None and read and plan.device is not None:
                    slot = self.series.norm_slot(plan.device)
                    if len(read) == 1:  # the usual: one op, inline
                        torch.linalg.vector_norm(read[0], dtype=torch.float64, out=slot)
                    else:
                        norm_into(slot, read)
                assert out is not None  # (chunks: at least one when fold is set)
                return Reading([out], plan.seen)
            except (RuntimeError, UserWarning):
                if again:  # (exact, and per gradient: never no check)
                    return self.normed(self.layer_squares(), norm)
                plan = self._make_check_plan(grads, missing)
        raise AssertionError("unreachable: the second attempt returns")

    def normed(self, squares: Reading, norm: bool = True) -> Reading:
        if norm and self.series is not None:
            self.series.write_norm_of_squares(squares.parts)
        return squares

    def _make_check_plan(self, grads: list[Any], missing: tuple[int, ...]) -> _CheckPlan:
        if len(self._check_plans) >= _MAX_PLANS:
            self._check_plans.clear()
        layer = self._table.param_layer
        present = [i for i, g in enumerate(grads) if g is not None]
        seen = frozenset(layer[i] for i in present)
        first = grads[present[0]] if present else None
        # no fused check (chunks None), still looked at for a move or a cast (its first gradient)
        plan = _CheckPlan(
            None if first is None else first.device,
            None if first is None else first.dtype,
            tuple(present[:1]),
            None,
            seen,
        )
        devices = {grads[i].device for i in present}
        if (
            first is not None
            and len(devices) == 1
            and not any(grads[i].is_sparse for i in present)
            and first.device.type in _FUSED_DEVICES
            and not (first.device.type == "cpu" and self.cpu_dot_per_tensor)
        ):
            chunks, order = self._chunks(
                grads, [i for i in present if grads[i].numel()], first.device
            )
            if order:
                plan = _CheckPlan(
                    first.device, grads[order[0]].dtype, tuple(order), tuple(chunks), seen
                )
        self._check_plans[missing] = plan
        return plan

    def _chunks(
        self, grads: list[Any], nonempty: list[int], device: torch.device
    ) -> tuple[list[_Chunk], list[int]]:
        layer = self._table.param_layer
        order: list[int] = []
        chunks: list[_Chunk] = []

        def add(kind: str, run: list[int]) -> None:
            sizes = [grads[i].numel() for i in run]
            if kind in ("scalar", "strided"):  # one value per gradient
                lengths, owners = None, [layer[i] for i in run]
            else:
                cut = [_pieces(n) for n in sizes]
                lengths = index_to_device([p for c in cut for p in c], device)
                owners = [layer[i] for i, c in zip(run, cut) for _ in c]
            start = len(order)
            order.extend(run)
            in_order = lengths is not None and all(map(operator.le, owners, owners[1:]))
            chunks.append(
                _Chunk(
                    start,
                    len(order),
                    kind,
                    sum(sizes),
                    lengths,
                    self._index(device, owners),
                    grads[run[0]].dtype == torch.float16,
                    index_to_device(_per_layer(owners, self._n), device) if in_order else None,
                )
            )

        for dtype in dict.fromkeys(grads[i].dtype for i in nonempty):  # first seen, first
            of_dtype = [i for i in nonempty if grads[i].dtype == dtype]
            scalar = [i for i in of_dtype if grads[i].dim() == 0]
            strided = [i for i in of_dtype if grads[i].dim() and not grads[i].is_contiguous()]
            dense = [i for i in of_dtype if grads[i].dim() and grads[i].is_contiguous()]
            large = [i for i in dense if grads[i].numel() * grads[i].element_size() >= _CHUNK_BYTES]
            for run in _runs_within([i for i in dense if i not in large], grads, _CHUNK_BYTES):
                add("cat", run)
            for i in large:
                add("view", [i])
            if strided:
                add("strided", strided)
            if scalar:
                add("scalar", scalar)
        return chunks, order

    def layer_squares(self) -> Reading:
        """Per device: (squared L2 norm of each layer's gradients over that device's
        parameters, float64 of length len(table)); and the layers that had any gradient."""
        if self._distributed:
            return self._grouped()
        grads: list[Any] = [p.grad for p in self._params]
        missing = tuple(i for i, g in enumerate(grads) if g is None)
        if missing:
            grads = [g for g in grads if g is not None]
            if not grads:
                return Reading([], frozenset())
        plan = self._plans.get(missing)
        # one device check per step: a model moved with .to() after attach gets a new plan
        if plan is None or (plan.device is not None and grads[0].device != plan.device):
            plan = self._make_plan(grads, missing)
        index = plan.layer_index
        if plan.device is None or index is None:  # (both None together: the general path)
            return self._grouped()
        if plan.device.type == "cpu" and self.cpu_dot_per_tensor:
            squares = _cpu_squared_norms(grads)
            per_layer = torch.zeros(len(self._table), dtype=torch.float64)
            return Reading([per_layer.index_add_(0, index, squares)], plan.seen)
        return Reading([fused_layer_squares(grads, index, len(self._table))], plan.seen)

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

    def _grouped(self) -> Reading:
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
    """Squared L2 norm of each CPU gradient, float64: one BLAS dot each. A float32 dot
    accumulates and returns float32, so a finite gradient whose norm passes ~1.8e19 (an
    exploding LSTM's, issue 38) would square to inf and read as non-finite: those few are
    taken again in float64 (a CPU tensor is read without waiting for anything; where tests
    emulate a device on the CPU, transfer.on_host says no and nothing is read)."""
    squares = []
    for g in grads:
        if g.dtype in _BLAS_DTYPES:
            flat = g.reshape(-1)
            squares.append(torch.dot(flat, flat))
        else:
            squares.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
    out = torch.stack(squares).to(torch.float64)
    if transfer.on_host(out) and not bool(torch.isfinite(out).all()):
        for k in torch.nonzero(torch.isinf(out)).flatten().tolist():
            if bool(torch.isfinite(grads[k]).all()):
                out[k] = torch.linalg.vector_norm(grads[k], dtype=torch.float64).square()
    return out


def layer_squares(
    groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]],
    n: int,
    index_cache: dict | Callable[[torch.device, list[int]], torch.Tensor],
    *,
    cpu_dot: bool = True,
) -> Reading:
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
            cached = index_cache.get(key)
            if cached is None:
                cached = index_cache[key] = index_to_device(layers, device)
            index = cached
        if device.type == "cpu" and cpu_dot:
            per_layer = torch.zeros(n, dtype=torch.float64)
            out.append(per_layer.index_add_(0, index, _cpu_squared_norms(tensors)))
        else:
            out.append(fused_layer_squares(tensors, index, n))
        seen.update(layers)
    return Reading(out, frozenset(seen))


class StepGradients:
    """This step's per-layer gradient values, two readings of them:

    - `squares`, where the update reads the gradients (the optimizer's pre-hook, or the
      step's end when none ran), read once per step: exact norms on sampled steps (the
      figures, as the update sees them: unscaled, clipped), per-layer check values on the
      others. It says *whether* the step's update got non-finite gradients: what the
      detector counts and the policies act on. Gradients the loop drops before any update
      (a loss scaler's overflow that is not torch's GradScaler, a GAN's generator pass
      through the discriminator, a guard that zeroes them) are not an incident.
    - `backward`, at the end of each backward through the model's output (backward_end.py),
      as backward left them: says *which* layer went first. Code between backward() and
      the optimizer may rewrite gradients (a clip by a NaN total norm makes every one NaN),
      so when both readings are non-finite the layers come from this one (`checked`).
      Several backwards in one step add up: a NaN in any of them stays in the sum.

    Owned by the profiler; the training thread, or autograd's thread while the training
    thread waits in backward()."""

    __slots__ = (
        "_norms",
        "_every_step",
        "_wanted",
        "squares",
        "exact",
        "backward",
        "read_at_update",
        "_unscaled",
    )

    def __init__(self, norms: GradientNorms, *, every_step: bool = True):
        self._norms = norms
        # checked on every step (nonfinite_check="all"), not only on sampled ones; never off
        # because of a fault elsewhere (DESIGN.md invariant 3)
        self._every_step = every_step
        # (per-device squares, the layers that had a gradient), or None: not read this step;
        # not `exact`: per-layer values to check for NaN/Inf only, not norms
        self.squares: Reading | None = None
        self.exact = True
        # (per-device check values, layers seen) at the end of this step's backwards, or None
        self.backward: Reading | None = None
        self._wanted = every_step  # this step checks its gradients (new_step)
        self._unscaled = False  # a fused GradScaler step has unscaled this reading (unscale)
        self.read_at_update = False  # an optimizer's pre-hook asked this step (read_once)

    def backward_ended(self) -> None:
        """A backward through the model finished: check its gradients now (a constant handful
        of ops: GradientNorms.layer_checks), added to this step's earlier backwards' values."""
        if not self._wanted:
            return
        reading = self._norms.layer_checks()
        if self.backward is None:
            self.backward = reading
            return
        earlier = {p.device: p for p in self.backward.parts}
        for part in reading.parts:  # (one device: one add)
            before = earlier.get(part.device)
            earlier[part.device] = part if before is None else before + part
        self.backward = Reading(list(earlier.values()), self.backward.seen | reading.seen)

    def read_once(self, sampled: bool, *, at_update: bool = False) -> None:
        """Read them now if this step wants them and they were not read yet: on a sampled
        step per-layer squared norms (its figures, `exact`); on another, per-layer values
        that are only checked for NaN/Inf (GradientNorms.layer_checks)."""
        if (
            at_update
        ):  # (an optimizer's pre-hook: the step's end need not look at late replays again)
            self.read_at_update = True
        if self.squares is None and (sampled or self._every_step):
            norms = self._norms  # with the step's global norm (step/series.py)
            self.squares = (
                norms.normed(norms.layer_squares()) if sampled else norms.layer_checks(norm=True)
            )
            self._unscaled = False
            self.exact = sampled

    def at_step_end(
        self, sampled: bool
    ) -> tuple[Reading | None, dict[torch.device, torch.Tensor] | None]:
        """The step ends (no optimizer hook may have read them: prof.step() alone): read
        once if still wanted. Returns what the step's non-finite check counts: the update's
        reading and, where the gradients were also read as the backwards ended, that
        reading's values per device (None when there is no such pair). The detector joins
        them on the device (DeviceCounters.end_step): the layers come from the backward's
        reading where both are non-finite (a NaN backward made, then spread to every layer
        by a clip); a NaN made after backward() (an edit through .data, an all-reduce that
        overflows) keeps the update's layers; one the loop dropped before the update is no
        incident, and is counted apart. Nothing but the reading issues an op."""
        if self.squares is None:
            self.read_once(sampled)
        backward, update = self.backward, self.squares
        if backward is None or update is None:
            return update, None
        by_device = {}
        for p in backward.parts:  # (a loop, not a comprehension: no Python call each step)
            by_device[p.device] = p
        return update, by_device

    def forget(self) -> None:
        """A closure ran another backward: read again at the update when next needed."""
        self.squares = None

    def new_step(self, sampled: bool) -> None:
        self.squares = None
        self._unscaled = False
        self.backward = None
        self.read_at_update = False
        self._wanted = sampled or self._every_step

    def unscale(self, view: Any) -> None:
        """A fused optimizer's GradScaler step (guard.ScalerView): norms of the unscaled
        gradients, as the update sees them."""
        if view is None or self.squares is None or self._unscaled:
            return  # (two fused optimizers under one scaler: one reading, unscaled once)
        self._unscaled = True
        if self._norms.series is not None:  # the step's global norm too
            self._norms.series.unscale_norm(view.scale, view.found_inf)
        if self.exact:
            self.squares = Reading(view.unscale(self.squares.parts), self.squares.seen)


def no_gradients_notice(model_type: str, backward: Any = None) -> str:
    """Said once when a step that ran its forward ends with no gradient to read (`backward`:
    what its backwards' ends checked, when they were seen)."""
    checks = (
        "gradient norms have nothing to read (the NaN/Inf check read them as the backward ended)"
        if backward is not None and backward.seen
        else "gradient norms and the per-layer backward check have nothing to read"
    )
    return (
        f"no parameter of {model_type} had a gradient at the end of a step that ran its "
        f"forward, so {checks}: "
        "end steps after the backward and before zero_grad() (prof.step() there, or a "
        "torch.optim step); gradients computed functionally (torch.func) are not in .grad"
    )
