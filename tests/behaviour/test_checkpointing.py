"""Activation checkpointing (torch.utils.checkpoint, reentrant and not): the forward that
backward recomputes is reported as recomputation, never as forward time; forward and
backward times of the checkpointed layers are still reported; numerics are unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from support.metrics import parse, samples
from support.models import run_optionally_profiled


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def run(reentrant: bool, settings: dict | None, steps: int = 5):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)

    def train_step():
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    _, snap, text = run_optionally_profiled(model, settings, steps, train_step, scrape_metrics=True)
    return model, snap, parse(text) if text is not None else None


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_recomputation_is_reported_apart_and_never_as_forward(reentrant, every_step):
    reference, _, _ = run(reentrant, None)
    model, snap, families = run(reentrant, every_step)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)

    inside = ["block.0", "block.1", "block.2"]
    outside = ["stem", "head"]
    for name in inside:
        layer = snap.layers[name]
        # one forward call and one recomputation per step, each counted once
        assert layer.forward_calls_total == 5, name
        assert layer.recompute_calls_total == 5, name
        assert layer.forward_seconds > 0 and layer.recompute_seconds > 0, name
        assert layer.backward_calls_total > 0, name  # backward times still reported
    for name in outside:
        assert snap.layers[name].forward_calls_total == 5, name
        assert snap.layers[name].recompute_calls_total == 0, name
    recomputed = samples(
        families, "hookprof_layer_recompute_seconds", "hookprof_layer_recompute_seconds_count"
    )
    assert {dict(k)["layer"] for k in recomputed} == set(inside)
    assert all(v == 5 for v in recomputed.values())
    forward = samples(
        families, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count"
    )
    assert {dict(k)["layer"]: v for k, v in forward.items()} == {n: 5 for n in inside + outside}
