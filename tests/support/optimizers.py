"""The optimizers the NaN-guard tests step, by the implementation that matters to the guard
(fused kernels take a found_inf flag on the device; for-each ones do not)."""

from __future__ import annotations

import torch


def adam(model, kind: str) -> torch.optim.Optimizer:
    """Adam (lr 1e-3) with one implementation switched on: kind is "fused" or "foreach"."""
    return torch.optim.Adam(model.parameters(), lr=1e-3, **{kind: True})


def momentum_sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
