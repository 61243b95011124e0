"""Finding the tensors in a module's inputs and outputs (tensors, sequences, mappings), and
reading a tensor's bits as integers (the parameters' fingerprint, hookprof/integrity/, and the
output checksums of a replay check)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_MAX_TENSORS_PER_CALL = 8  # outputs/inputs looked at per call; a tuple of 1,000 is not a layer

# the integer of each element width a tensor's bits are read as
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_bits(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor, detached, as integers of its elements' width (a complex
    one as its real view; a DTensor as its local shard): a view, no copy."""
    t = tensor.detach()
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


# elements summed per reduction: a sum to int64 of narrower integers converts them first, a
# transient of 8 bytes an element (8x a bfloat16 tensor), so large tensors go in chunks of at
# most 32 MiB of int64
BITS_SUM_CHUNK = 1 << 22


def bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of a tensor's bits read as integers (`local_bits`), 0-d on its
    device: exact and independent of the order a kernel reduces in, so equal bits give equal
    sums everywhere (chunked or not), and any one flipped bit changes it (by +-2^k modulo
    2^64)."""
    bits = local_bits(tensor)
    if bits.numel() <= BITS_SUM_CHUNK:
        return bits.sum(dtype=torch.int64)
    chunks = bits.reshape(-1).split(BITS_SUM_CHUNK)  # (a copy only of a non-contiguous one)
    return torch.stack([c.sum(dtype=torch.int64) for c in chunks]).sum()


def summable(t: torch.Tensor) -> bool:
    """Is `t` an output whose bits a replay's checksum reads: floating or complex, strided
    (a sparse tensor has no bits to view), not empty."""
    return (t.is_floating_point() or t.is_complex()) and t.layout is torch.strided and t.numel() > 0


def output_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A layer output's bits summed as integers in a width the device sums natively, 0-d on
    its device: the elements' own width for 4- and 8-byte ones (int32, int64); for 1- and
    2-byte ones (bfloat16, float16, fp8) their bytes read as int32 where the tensor is
    contiguous and its size a multiple of 4 bytes, else converted to int32. Exact and
    order-free like `bits_sum` (integer addition modulo 2^32 or 2^64), and any one flipped
    bit changes it, but with no conversion and no transient where the bytes can be read as
    they lie: one read of the tensor. (`bits_sum`'s int64 sum of 4-byte elements converts
    them first: 8x slower on a CPU, measured on a 1M-element float32 output. The replay
    checks' sums compare two forwards with each other, never with another width's.)"""
    bits = local_bits(tensor)
    if bits.element_size() >= 4:
        return bits.sum(dtype=bits.dtype)
    size = bits.element_size()
    if (
        bits.is_contiguous()
        and bits.numel() * size % 4 == 0
        and bits.storage_offset() * size % 4 == 0
    ):
        # (the bytes read as int32 must start on a 4-byte boundary: a slice of a bfloat16
        # tensor starting at an odd element cannot be viewed so)
        return bits.reshape(-1).view(torch.int32).sum(dtype=torch.int32)
    if bits.numel() <= BITS_SUM_CHUNK:  # (a transient of 4 bytes an element, chunked)
        return bits.sum(dtype=torch.int32)
    chunks = bits.reshape(-1).split(BITS_SUM_CHUNK)
    return torch.stack([c.sum(dtype=torch.int32) for c in chunks]).sum(dtype=torch.int32)


def bits_square_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of the squares of a tensor's bits read as integers, 0-d on its
    device: exact and order-free like `bits_sum`, and not linear in them, so changes that
    cancel in `bits_sum` (one element a unit up, another a unit down: a value added and
    taken off again rounds both ways) do not cancel here, save by coincidence."""
    bits = local_bits(tensor).reshape(-1)
    # (int64 transients of a chunk at most; a copy whatever the width: an int64 chunk, a
    # float64 parameter's bits, would otherwise be the parameter itself, squared in place)
    if bits.numel() <= BITS_SUM_CHUNK:  # one chunk: 3 ops (a check step's watch, per tensor)
        wide = bits.to(torch.int64, copy=True)
        return wide.mul_(wide).sum()
    sums = []
    for chunk in bits.split(BITS_SUM_CHUNK):
        wide = chunk.to(torch.int64, copy=True)
        sums.append(wide.mul_(wide).sum())
    return torch.stack(sums).sum()


def iter_tensors(value: Any, limit: int = _MAX_TENSORS_PER_CALL) -> Iterable[torch.Tensor]:
    """Tensors in a module's inputs or outputs: tensors, tuples/lists (named tuples too),
    mapping values (HF ModelOutput is an OrderedDict) and dataclass fields."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if type(value) is tuple and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value  # the common case: forward(x)
    return _walk_tensors(value, limit)


def _walk_tensors(value: Any, limit: int) -> Iterator[torch.Tensor]:
    stack = [value]
    found = 0
    while stack and found < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found += 1
            yield item
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(reversed([getattr(item, f.name) for f in dataclasses.fields(item)]))


def every_tensor(value: Any) -> Iterator[torch.Tensor]:
    """All the tensors in `value` (a state_dict, a batch), with no cap: iter_tensors looks at
    a call's first few only, which is right for a hook and wrong for a size or a list."""
    return _walk_tensors(value, limit=sys.maxsize)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with each tensor replaced by `fn(tensor)`, through tuples (named ones too),
    lists and dicts; anything else kept as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    return value
