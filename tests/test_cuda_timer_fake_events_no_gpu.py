"""The CUDA timing path with stand-in events: there is no GPU here. What is tested is
everything that is not CUDA itself: pooling, recording at mark(), resolution off-thread,
and the aggregator consuming event tokens exactly as it consumes CPU ones."""

from __future__ import annotations

import itertools

import pytest

from hookprof.timing import CpuTimer, CudaEventTimer

_clock = itertools.count(1000, 250)  # a fake device clock in microseconds


class FakeEvent:
    """Mimics torch.cuda.Event(enable_timing=True): record(), synchronize(), elapsed_time()."""

    def __init__(self):
        self.t_us = None
        self.synced = False

    def record(self):
        self.t_us = next(_clock)

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):  # milliseconds, as CUDA reports them
        return (end.t_us - self.t_us) / 1000.0


def test_events_are_pooled_and_reused():
    timer = CudaEventTimer(event_factory=FakeEvent)
    first = [timer.mark() for _ in range(5)]
    assert timer.created == 5 and len({id(e) for e in first}) == 5
    timer.release(first)
    second = [timer.mark() for _ in range(5)]
    assert timer.created == 5  # nothing new: all five came from the pool
    assert {id(e) for e in second} == {id(e) for e in first}
    third = timer.mark()
    assert timer.created == 6 and id(third) not in {id(e) for e in first}


def test_seconds_waits_on_the_end_event_and_converts_units():
    timer = CudaEventTimer(event_factory=FakeEvent)
    start, end = timer.mark(), timer.mark()
    assert timer.seconds(start, end) == pytest.approx(250e-6)
    assert end.synced


def test_profiler_steps_with_the_event_timer(every_step):
    """A CPU model run through the event timer: per-layer times come out of event pairs,
    and every event goes back to the pool after the publisher has read it."""
    import hookprof
    from models import DeepNet, seeded, train

    timer = CudaEventTimer(event_factory=FakeEvent)
    model = seeded(DeepNet)
    cfg = hookprof.Config(**every_step)
    prof = hookprof.Profiler(model, cfg, timer=timer)
    try:
        train(model, 3, prof=prof, explicit_step=True)
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    for name in model.order():
        assert snap.layers[name].forward_seconds_total > 0
        assert snap.layers[name].backward_seconds_total > 0
    assert len(timer._pool) == timer.created  # every event released after use


def test_cpu_timer_uses_the_injected_clock():
    ticks = iter([10, 2_000_000_010])
    timer = CpuTimer(clock=lambda: next(ticks))
    assert timer.seconds(timer.mark(), timer.mark()) == pytest.approx(2.0)
