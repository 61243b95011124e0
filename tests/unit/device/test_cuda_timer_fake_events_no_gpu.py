"""The CUDA timing path with stand-in events: there is no GPU here. What is tested is
everything that is not CUDA itself: pooling, recording at mark(), resolution off-thread,
and the aggregator consuming event tokens exactly as it consumes CPU ones."""

from __future__ import annotations

import pytest

from hookprof import _testing
from hookprof.device.timing import RESOLVE_CHUNK, CpuTimer, CudaEventTimer
from support.fake_gpu import FakeEvent, FakeStream


def fake_timer(**kwargs) -> tuple[CudaEventTimer, list[FakeStream]]:
    """A CudaEventTimer over fake events; the list records every current-stream lookup."""
    stream = FakeStream()
    lookups: list[FakeStream] = []

    def current_stream():
        lookups.append(stream)
        return stream

    return CudaEventTimer(event_factory=FakeEvent, current_stream=current_stream, **kwargs), lookups


def test_events_are_pooled_and_reused():
    timer, _ = fake_timer()
    first = [timer.mark() for _ in range(5)]
    assert timer.created == 5 and len({id(e) for e in first}) == 5
    timer.release(first)
    second = [timer.mark() for _ in range(5)]
    assert timer.created == 5  # nothing new: all five came from the pool
    assert {id(e) for e in second} == {id(e) for e in first}
    third = timer.mark()
    assert timer.created == 6 and id(third) not in {id(e) for e in first}


def test_seconds_waits_on_the_end_event_and_converts_units():
    timer, _ = fake_timer()
    start, end = timer.start(), timer.mark()
    assert timer.seconds(start, end) == pytest.approx(250e-6)
    assert end.synced


def test_profiler_steps_with_the_event_timer(every_step):
    """A CPU model run through the event timer: per-layer times come out of event pairs,
    and every event goes back to the pool after the publisher has read it."""
    import hookprof
    from support.models import DeepNet, seeded, train

    timer, lookups = fake_timer()
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
    assert len(_testing.pooled_events(timer)) == timer.created  # every event released after use
    # the stream is looked up once per sampled step, not at every mark (the fourth has begun)
    assert snap.sampled_steps == 3 and len(lookups) == 4
    assert timer.created > 50


def test_cpu_timer_uses_the_injected_clock():
    ticks = iter([10, 2_000_000_010])
    timer = CpuTimer(clock=lambda: next(ticks))
    assert timer.seconds(timer.mark(), timer.mark()) == pytest.approx(2.0)


def test_a_step_is_resolved_with_one_wait():
    """Two thousand marks of one step: one synchronize (on the last event recorded), then
    elapsed times; the GIL is released every RESOLVE_CHUNK events."""
    yields = []
    timer, _ = fake_timer(yield_gil=lambda: yields.append(1))
    ref = timer.start()
    tokens = [timer.mark() for _ in range(2000)]
    before = FakeEvent.syncs
    times = timer.resolve(ref, [ref, *tokens])
    assert FakeEvent.syncs - before == 1
    assert times[ref] == 0.0
    assert [times[t] for t in tokens] == pytest.approx([(k + 1) * 250e-6 for k in range(2000)])
    assert len(yields) == 2001 // RESOLVE_CHUNK


def test_an_event_the_last_wait_does_not_cover_is_waited_for_alone():
    """A stream switched between steps: the event recorded last is on another stream, so
    waiting on it completes nothing of this step's; each event is then waited for alone
    instead of failing."""
    timer, _ = fake_timer()
    ref = timer.start()
    step_tokens = [timer.mark() for _ in range(3)]
    other = FakeStream()
    setattr(*_testing.current_stream_seam(timer), lambda: other)
    timer.start()  # the next step, on another stream, marked last
    times = timer.resolve(ref, step_tokens)
    assert [times[t] for t in step_tokens] == pytest.approx([250e-6, 500e-6, 750e-6])
    assert all(t.synced for t in step_tokens)
