"""Training compared bit for bit against a reference run made without hookprof, and
finiteness of what an update may have touched."""

from __future__ import annotations

import torch


def assert_same(a_model, b_model) -> None:
    """Every parameter equal, bit for bit (the first that differs is named)."""
    for (name, a), b in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(a, b), name


def finite(values) -> bool:
    """Every value (tensors or numbers; None skipped) is finite everywhere."""
    return all(torch.isfinite(torch.as_tensor(v)).all() for v in values if v is not None)


def same_bits(a, b) -> bool:
    """Two lists of float32 tensors hold the very same bits (NaN-aware: a NaN equals the
    same NaN)."""
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b)
    )
