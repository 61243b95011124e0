"""A fingerprint of a model's parameters, taken on the device: data-parallel replicas must hold
bit-identical parameters after every update, so replicas whose fingerprints differ at the
same step hold different weights, and one of them was corrupted (issue 43 item 4).

The fingerprint is a wrapping integer sum of every parameter's bits, each element read as the
signed integer of its own width (float32 as int32, bfloat16 and float16 as int16, float64 as
int64), each parameter's sum weighted by an odd number from its position (odd: invertible
modulo 2^64, so no flip of a high bit is multiplied away). Integer addition is exact and
associative, so the value does not depend on the order a kernel reduces in: the same bits
give the same fingerprint on every device, every run. One bit flipped anywhere changes it
(a flip changes its element by +-2^k, and the sum modulo 2^64 with it). Two corruptions that
cancel, or two equal elements swapped within a parameter, would not: the check is for a
device that computes or holds wrong values, not for an adversary.

Taken on a check step only (Config.sdc_check_interval_s: one reduction per parameter, a few
more ops, no read back); its two 32-bit halves ride the step's own copy to the host as
float64 values, which hold them exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hookprof.device.transfer import index_to_device
from hookprof.snapshot import ParameterChange
from hookprof.tensors import bits_square_sum, bits_sum

# a fingerprint as exported: 52 bits, exact in a float64 sample value
EXPORTED_BITS = 52
# changed_parameters' position when no parameter changed (exact in float64)
NONE_CHANGED = 1 << 62


def parameter_sums(
    params: Sequence[torch.Tensor], *, squares: bool = False
) -> list[tuple[list[int], torch.Tensor]]:
    """Per device: the positions (in `params`) of the parameters on it, and a 1-d int64 tensor
    of each one's wrapping bits sum (tensors.bits_sum), on that device (nothing read back).
    `squares`: [parameters, 2], each one's bits sum and the sum of its bits' squares
    (tensors.bits_square_sum), for the parameter watch: a value added and taken off again
    rounds some elements a unit up and others a unit down, which the bits sum alone misses
    whenever as many went each way (measured: two parameters in three of a small model)."""
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for i, p in enumerate(params):
            total = bits_sum(p)
            if squares:
                total = torch.stack([total, bits_square_sum(p)])
            where, sums = by_device.setdefault(total.device, ([], []))
            where.append(i)
            sums.append(total)
        return [(where, torch.stack(sums)) for where, sums in by_device.values()]


def device_fingerprints(
    params: Sequence[torch.Tensor], weights: dict[Any, torch.Tensor]
) -> list[torch.Tensor]:
    """One int64 0-d tensor per device: the weighted wrapping sum of the bits of the
    parameters on it (see the module's docstring). `weights` caches each device's position
    weights (2 x the parameter's index + 1), made at the first call."""
    out = []
    with torch.no_grad():
        for where, sums in parameter_sums(params):
            key = (sums.device, tuple(where))  # (the same positions: made once, kept)
            w = weights.get(key)
            if w is None:
                odd = [2 * i + 1 for i in where]
                w = weights[key] = index_to_device(odd, sums.device)  # (no sync on CUDA)
            out.append((sums * w).sum())
    return out


# a parameter's marks of a write the program made (write_marks)
Mark = tuple[int, int]


def write_marks(params: Sequence[torch.Tensor]) -> list[Mark]:
    """What changes, on the host, when a program writes a parameter where torch sees it: its
    version counter (any in-place op on it) and its data's address (new data assigned, as
    MoCo's `param.data = ...`). A flipped bit in a device's memory changes neither; a write
    through `.data` neither (its version counter is another's)."""
    marks = []
    for p in params:
        t = getattr(p, "_local_tensor", p)  # (a DTensor's shard)
        marks.append((t._version, t.data_ptr()))
    return marks


def changed_parameters(
    before: list[tuple[list[int], torch.Tensor]],
    after: list[tuple[list[int], torch.Tensor]],
    compared: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Per device, from two `parameter_sums` of the same parameters: (how many changed, the
    position in `params` of the first that did; with none, a position past them all), as
    float64 on the device (exact), nothing read back. `compared`: per position in `params`,
    whether it counts (None: all do)."""
    out = []
    with torch.no_grad():
        for (where, old), (_, new) in zip(before, after, strict=True):
            changed = old != new
            if changed.dim() == 2:  # (each parameter's sums: any that differs)
                changed = changed.any(1)
            if compared is not None and not all(compared[i] for i in where):
                kept = index_to_device([int(compared[i]) for i in where], old.device)
                changed = changed & kept.bool()
            positions = index_to_device(where, old.device)  # (no sync on CUDA)
            first = torch.where(changed, positions, NONE_CHANGED).min()
            out.append(torch.stack([changed.sum(), first]).to(torch.float64))
    return out


def halves(fingerprint: torch.Tensor) -> torch.Tensor:
    """A device fingerprint as its two 32-bit halves (high, low), float64: exact on the host."""
    low = fingerprint & 0xFFFFFFFF
    high = (fingerprint >> 32) & 0xFFFFFFFF
    return torch.stack([high, low]).to(torch.float64)


def combine(values: Sequence[float]) -> int:
    """The host's fingerprint from the halves of every device's, as `halves` sent them
    ([high, low, high, low, ...]): their sum modulo 2^64, folded into EXPORTED_BITS."""
    total = 0
    for k in range(0, len(values), 2):
        total += (int(values[k]) << 32) | int(values[k + 1])
    total &= (1 << 64) - 1
    mask = (1 << EXPORTED_BITS) - 1
    return (total ^ (total >> EXPORTED_BITS)) & mask


def parameter_change(
    step: int, values: Sequence[float], names: Sequence[str], now: float = 0.0
) -> ParameterChange | None:
    """The host's reading of `changed_parameters` ([count, first, count, first, ...], one pair
    per device; `names`: the parameters the positions are of), judged at `now` (Unix
    seconds): the change, or None."""
    pairs = [(int(values[k]), int(values[k + 1])) for k in range(0, len(values), 2)]
    changed = sum(count for count, _ in pairs)
    if not changed:
        return None
    first = min(position for count, position in pairs if count)
    return ParameterChange(step, names[first], changed, now)


def replica_group(named_params: Sequence[tuple[str, torch.Tensor]], run: str, group: str) -> str:
    """A short hash naming the ranks that must hold the same parameters: the same run
    (`run`: run_identity()), the same parameters' names, shapes and dtypes, and the same
    `group` the user gives (Config.sdc_replica_group: a pipeline stage's or a tensor-parallel
    rank's coordinate, where those hold different values under the same names and shapes)."""
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in named_params)
    return hashlib.sha256(f"{run}|{group}|{text}".encode()).hexdigest()[:12]


def run_identity(environ: Mapping[str, str], process: str) -> str:
    """What the ranks of one run share and another run does not: torchrun's run id, else the
    rendezvous address and port every rank was given; else `process` (a process of its own,
    never another's replica)."""
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "run:" + environ["TORCHELASTIC_RUN_ID"]
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return f"rendezvous:{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return "process:" + process
