"""hookprof_step_phase_seconds: each phase's host time per step, checked against a fake clock
that the loop, the model and the optimizer advance by known amounts (so the expected figures
are computed independently of hookprof), for a plain loop, a closure optimizer (LBFGS), an
evaluation pass between steps, and an expect_slow section."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from support.metrics import parse, samples, scrape
from support.phase_clock import FakeClock, phases


class TimedNet(nn.Module):
    """Its forward takes `forward_ms` on the fake clock."""

    def __init__(self, clock: FakeClock, forward_ms: int):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.clock, self.forward_ms = clock, forward_ms

    def forward(self, x):
        self.clock.advance(self.forward_ms)
        return self.fc(x)


class TimedSGD(torch.optim.SGD):
    """An update that takes `step_ms` on the fake clock. Its step calls SGD's: once an SGD
    has been made, torch has wrapped both classes' step with the optimizer hooks, which then
    run twice (inner and outer), as for any optimizer subclass that calls super().step()."""

    def __init__(self, params, clock: FakeClock, step_ms: int):
        super().__init__(params, lr=0.01)
        self.clock, self.step_ms = clock, step_ms

    def step(self, closure=None):
        self.clock.advance(self.step_ms)
        return super().step(closure)


torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # wraps SGD.step (see TimedSGD)


def profiler(model, clock, **overrides):
    config = hookprof.Config(port=0, stall_detection=False, **overrides)
    return hookprof.Profiler(model, config, clock=clock)


def test_plain_loop_with_prof_step():
    clock = FakeClock()
    model = TimedNet(clock, forward_ms=7)
    opt = TimedSGD(model.parameters(), clock, step_ms=3)
    prof = profiler(model, clock)
    x = torch.randn(8, 4)
    try:
        for _ in range(4):
            clock.advance(5)  # loading the batch
            loss = model(x).pow(2).mean()
            loss.backward()
            clock.advance(11)  # the rest of the backward
            opt.step()
            opt.zero_grad()
            clock.advance(2)  # logging before the step's end
            prof.step(loss)
        # the first step's clock starts at its first forward: its data phase is not seen; and
        # until prof.step() is first called the optimizer ends steps, so step 1 has no other
        # and its 2 ms of logging are step 2's wait for data
        assert phases(prof) == {
            "data": 17.0,
            "forward": 28.0,
            "backward": 44.0,
            "optimizer": 12.0,
            "other": 6.0,
        }
        snap = prof.snapshot()
        assert sum(snap.phase_seconds.values()) == pytest.approx(snap.step_duration_sum, abs=1e-12)
        page = parse(scrape(prof.url))
        count = samples(page, "hookprof_step_phase_seconds", "hookprof_step_phase_seconds_count")
        total = samples(page, "hookprof_step_phase_seconds", "hookprof_step_phase_seconds_sum")
        assert count == {
            frozenset({"rank": "0", "phase": p}.items()): 4
            for p in ("data", "forward", "backward", "optimizer", "other")
        }
        assert total[frozenset({"rank": "0", "phase": "backward"}.items())] == pytest.approx(0.044)
        where = samples(page, "hookprof_progress_phase")
        assert where == {frozenset({"rank": "0", "phase": "data"}.items()): 0.0}
        assert samples(page, "hookprof_progress_step") == {frozenset({"rank": "0"}.items()): 5.0}
    finally:
        prof.detach()


def test_closure_optimizer_counts_its_forwards_and_backwards():
    clock = FakeClock()
    model = TimedNet(clock, forward_ms=7)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    prof = profiler(model, clock)
    x, calls = torch.randn(8, 4), []

    def closure():
        calls.append(1)
        opt.zero_grad()
        clock.advance(1)  # inside optimizer.step, before the forward
        loss = model(x).pow(2).mean()
        loss.backward()
        clock.advance(11)
        return loss

    try:
        for _ in range(3):
            clock.advance(5)
            opt.step(closure)
        n = len(calls)
        assert n > 3  # LBFGS evaluated the closure several times per step
        # data: prev step's end to the optimizer's pre-hook; optimizer: the closure's time before
        # its forward, and LBFGS's own (none on this clock). The first step's clock starts at
        # its first forward, so its 5 ms of data and first 1 ms in the optimizer are not seen
        assert phases(prof) == {
            "data": 10.0,
            "forward": 7.0 * n,
            "backward": 11.0 * n,
            "optimizer": 1.0 * (n - 1),
            "other": 0.0,
        }
    finally:
        prof.detach()


def test_evaluation_and_expect_slow_are_outside_the_step_and_count_as_other():
    clock = FakeClock()
    model = TimedNet(clock, forward_ms=7)
    opt = TimedSGD(model.parameters(), clock, step_ms=3)
    prof = profiler(model, clock)
    x = torch.randn(8, 4)

    def train_step():
        clock.advance(5)
        model(x).pow(2).mean().backward()
        clock.advance(11)
        opt.step()  # ends the step (no prof.step() in this loop)
        opt.zero_grad()

    try:
        train_step()
        clock.advance(4)  # before the evaluation: still the next step's data wait
        model.eval()
        with torch.no_grad():
            model(x)  # 7 ms, outside the step
        model.train()
        prof.flush()
        where = prof.snapshot().progress
        assert (where.step, where.phase, where.label) == (2, "outside", "eval")
        clock.advance(6)
        with prof.expect_slow("checkpoint"):
            clock.advance(20)
            prof.flush()
            where = prof.snapshot().progress
            assert (where.phase, where.label, where.phase_seconds) == (
                "outside",
                "checkpoint",
                0.02,
            )
        train_step()
        # step 1: forward 7, backward 11, optimizer 3; step 2: data 4, then 7 + 6 + 20 + 5
        # outside (counted as other), forward 7, backward 11, optimizer 3
        assert phases(prof) == {
            "data": 4.0,
            "forward": 14.0,
            "backward": 22.0,
            "optimizer": 6.0,
            "other": 38.0,
        }
        snap = prof.snapshot()
        assert sum(snap.phase_seconds.values()) == pytest.approx(snap.step_duration_sum, abs=1e-12)
    finally:
        prof.detach()


def test_stall_settings_are_checked():
    with pytest.raises(hookprof.ConfigError, match="stall_max_s"):
        hookprof.Config(stall_min_s=10.0, stall_max_s=5.0)
    with pytest.raises(hookprof.ConfigError, match="stall_factor"):
        hookprof.Config(stall_factor=0.5)
    assert hookprof.Config.from_env({"HOOKPROF_STALL_MIN_S": "2.5"}).stall_min_s == 2.5
