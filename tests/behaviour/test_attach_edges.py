"""attach() where a model or a checkpoint is not the plain case: a scripted child, a part of
attach that fails, a whole-model checkpoint saved while attached by an earlier hookprof."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.step import boundary
from support.hooks_left import forward_hooks, forward_pre_hooks, global_hook_counts

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "support", "data", "attached_sequential_1dc2b42.pt")


class WithScriptedChild(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scripted = torch.jit.script(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.scripted(x))


def test_a_model_with_a_scripted_child_attaches_and_counts_its_steps():
    model = WithScriptedChild()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookprof.attach(model, port=0, summary_at_exit=False) as prof:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
        prof.flush()
        assert prof.snapshot().step == 3


def test_an_attach_that_fails_while_hooking_leaves_nothing_behind(monkeypatch):
    """The last registration of the step boundary fails: the ones before it come out too."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = global_hook_counts()

    def refuse(watcher):
        raise RuntimeError("injected: GradScaler cannot be watched")

    monkeypatch.setattr(boundary.gradscaler, "watch", refuse)
    with pytest.raises(RuntimeError, match="injected"):
        hookprof.attach(model, port=0, summary_at_exit=False)
    assert all(not forward_pre_hooks(m) and not forward_hooks(m) for m in model.modules())
    assert global_hook_counts() == before
    assert _testing.live_profilers() == []


def test_a_checkpoint_saved_while_attached_by_an_earlier_hookprof_loads_and_trains():
    """tests/support/data/attached_sequential_1dc2b42.pt: torch.save(model) of an nn.Sequential
    attached under hookprof at 1dc2b42, whose model hooks were the Profiler's own methods.
    It loads, its hooks are inert, it trains and nothing is profiled."""
    model = torch.load(CHECKPOINT, weights_only=False)
    hooks = [h for m in model.modules() for h in (*forward_pre_hooks(m), *forward_hooks(m))]
    assert hooks and all(type(h.__self__).__name__ == "InertProfiler" for h in hooks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.randn(3, 4))
    out.pow(2).mean().backward()
    opt.step()
    assert out.shape == (3, 2) and _testing.live_profilers() == []
