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

CHECKPOINT = os.path.join(
    os.path.dirname(__file__), "..", "support", "data", "attached_sequential_1dc2b42.pt"
)


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


def test_a_meta_device_model_is_refused_at_attach_with_the_fix():
    """Issue 39, item 4: attached on the meta device, then to_empty() and trained: an
    internal error, the backward count stuck at 0 while gradients were NaN, device='meta'
    in the event. Refused now, naming the parameters and the fix; nothing left behind; and
    attached after to_empty(), a NaN is named as usual."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(hookprof.MetaDeviceError) as info:
        hookprof.attach(model, port=0)
    assert info.value.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "to_empty" in str(info.value) and "0.weight" in str(info.value)
    assert not model._forward_hooks and not model._forward_pre_hooks
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookprof.attach(model, port=0, summary_at_exit=False) as prof:
        for step in range(1, 5):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            if step == 3:
                model[2].weight.grad[0, 0] = float("nan")
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.internal_errors == 0 and snap.nonfinite_steps["backward"] >= 1
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.step, snap.first_nonfinite.device) == (
        "2",
        3,
        "cpu",
    )
