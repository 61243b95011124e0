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
from collections.abc import Sequence

import torch

from hookprof.tensors import bits_sum

# a fingerprint as exported: 52 bits, exact in a float64 sample value
EXPORTED_BITS = 52


def device_fingerprints(
    params: Sequence[torch.Tensor], weights: dict[torch.device, torch.Tensor]
) -> list[torch.Tensor]:
    """One int64 0-d tensor per device: the weighted wrapping sum of the bits of the
    parameters on it (see the module's docstring). `weights` caches each device's position
    weights (2 x the parameter's index + 1), made at the first call."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
    with torch.no_grad():
        for i, p in enumerate(params):
            total = bits_sum(p)
            sums, where = by_device.setdefault(total.device, ([], []))
            sums.append(total)
            where.append(2 * i + 1)
        out = []
        for device, (sums, where) in by_device.items():
            w = weights.get(device)
            if w is None or w.numel() != len(where):
                w = weights[device] = torch.tensor(where, dtype=torch.int64, device=device)
            out.append((torch.stack(sums) * w).sum())
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


def layout_of(named_params: Sequence[tuple[str, torch.Tensor]]) -> str:
    """A short hash of the parameters' names, shapes and dtypes: only ranks with the same
    layout are replicas of each other (a pipeline stage, or a different model, is not)."""
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in named_params)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
