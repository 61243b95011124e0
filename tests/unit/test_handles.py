"""One undo style (issue 40, item 3): every install hookprof makes returns a handle whose
remove() is idempotent and which works in `with`; groups remove last in, first out, every
member even when one fails; nothing is undone by position (a replay's additions go, the
sampled step's stay)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.faults import DaemonThread
from hookprof.handles import Handle, HandleGroup
from support.models import DeepNet, seeded, train
from support.settings import EVERY_STEP, RARELY


def test_a_handle_undoes_once_and_in_a_with_block():
    calls = []
    handle = Handle(lambda: calls.append(1))
    assert not handle.removed
    handle.remove()
    handle.remove()
    assert calls == [1] and handle.removed
    with Handle(lambda: calls.append(2)) as h:
        assert not h.removed
    assert calls == [1, 2]


def test_a_group_removes_last_first_and_every_member_when_one_fails():
    order = []

    def boom():
        order.append("boom")
        raise RuntimeError("a member fails")

    group = HandleGroup()
    for name in ("a", "b"):
        group.add(Handle(lambda name=name: order.append(name)))
    group.add(Handle(boom))
    group.add(Handle(lambda: order.append("c")))
    with pytest.raises(RuntimeError, match="a member fails"):
        group.remove()
    assert order == ["c", "boom", "b", "a"] and len(group) == 0
    group.remove()  # empty: nothing again
    assert order == ["c", "boom", "b", "a"]


class _Sleeper(DaemonThread):
    def __init__(self):
        super().__init__("test-sleeper")
        self.stops = 0

    def _run(self):
        pass

    def stop(self, timeout: float = 5.0) -> None:
        self.stops += 1


def test_a_thread_start_returns_a_handle_that_stops_it_once():
    sleeper = _Sleeper()
    handle = sleeper.start()
    assert isinstance(handle, Handle)
    with handle:
        pass
    handle.remove()
    assert sleeper.stops == 1


def _hooks_of(model: nn.Module) -> int:
    """Forward hooks and wrapped forwards on the model's modules."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in vars(m))
        for m in model.modules()
    )


class Nested(nn.Module):
    """Containers with their own code between children: the replay hooks them too."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(x) * 2)


@pytest.mark.parametrize("sampled", [True, False], ids=["inside a sampled step", "alone"])
def test_a_replay_takes_out_its_own_additions_and_leaves_the_sampled_steps(sampled):
    """A replay adds the container modules' hooks: afterwards exactly those are gone
    (positions no longer decide), a sampled step's instrumentation stays until that step
    removes it, and detach leaves nothing."""
    from hookprof.step.record import StepRecord

    model = Nested()
    bare = _hooks_of(model)
    prof = hookprof.attach(model, summary_at_exit=False, **RARELY)
    try:
        model(torch.randn(2, 4))  # the root's own forward: its children's entry hooks go
        hooks = prof._hooks
        hooks.remove()  # whatever step 1 left: the test decides what is installed
        base = _hooks_of(model)  # the step boundary's root hooks alone
        if sampled:
            hooks.begin(StepRecord(None))
        step = _hooks_of(model)
        assert (step > base) == sampled
        with hooks.replaying_into(StepRecord(None)):
            model(torch.randn(2, 4))
            inside = _hooks_of(model)
        assert inside > step and _hooks_of(model) == step
        assert hooks.installed == sampled
        hooks.remove()
        hooks.remove()  # again: nothing
        assert _hooks_of(model) == base and not hooks.installed
    finally:
        prof.detach()
    assert _hooks_of(model) == bare


def test_attach_in_with_blocks_twice_leaves_nothing_behind():
    model = seeded(DeepNet, depth=1)
    bare = _hooks_of(model)
    for _ in range(2):
        with hookprof.attach(model, summary_at_exit=False, **EVERY_STEP) as prof:
            train(model, 3, prof=prof)
        assert _hooks_of(model) == bare
