"""Issue 29 item 6, DESIGN.md invariant 3: a snapshot that keeps failing to build backs off
instead of spinning the publisher thread, and the page still shows the faults and the steps
taken (exported from the faults and the step counters, not from the snapshot that cannot be
built), with hookprof_publisher_thread_up 0 while the snapshot is stale."""

from __future__ import annotations

import threading
import time

import hookprof
from hookprof.faults import PARTS
from hookprof.publish.publisher import Publisher
from support.metrics import errors_by_part, parse, samples, scrape
from support.models import MixedNet, seeded, train

RANK0 = frozenset({"rank": "0"}.items())


class FailingBuild(Publisher):
    """A Publisher whose snapshot build fails while `failing` is set; it counts its failed
    builds and the publisher thread's CPU time when each failed (time.thread_time)."""

    made: list[FailingBuild] = []

    def __init__(self, *args, **kwargs):
        self.failing = threading.Event()
        self.failed = 0
        self.cpu_at_failure: list[float] = []
        super().__init__(*args, **kwargs)
        FailingBuild.made.append(self)

    def _build(self):
        if self.failing.is_set():
            self.failed += 1
            if threading.current_thread().name.startswith("hookprof-publisher"):
                self.cpu_at_failure.append(time.thread_time())
            raise RuntimeError("injected snapshot build failure")
        return super()._build()


def _train_for(model, prof, seconds: float, max_steps: int = 100_000) -> int:
    """Train until `seconds` have passed (bounded by max_steps); returns the steps taken."""
    before = prof.steps
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and prof.steps - before < max_steps:
        train(model, 5)
    return prof.steps - before


def test_a_snapshot_build_that_keeps_failing_backs_off_and_the_page_shows_it():
    FailingBuild.made.clear()
    model = seeded(MixedNet)
    config = hookprof.Config(
        port=0, sample_every=1, min_sample_interval_s=0.0, publish_interval_s=0.2
    )
    with hookprof.Profiler(model, config, publisher=FailingBuild) as prof:
        publisher = FailingBuild.made[0]
        train(model, 3)
        assert prof.flush()
        healthy = parse(scrape(prof.url))
        assert samples(healthy, "hookprof_publisher_thread_up") == {RANK0: 1.0}
        assert errors_by_part(healthy) == dict.fromkeys(PARTS, 0.0)

        publisher.failing.set()
        cpu_before = time.thread_time()  # (this thread's: the training thread)
        steps = _train_for(model, prof, 3.0)
        training_cpu = time.thread_time() - cpu_before
        failing_steps = prof.steps
        page = parse(scrape(prof.url))

        # bounded: 0.05 s doubling to 5 s is ~7 tries in 3 s, plus the scrape's; pre-fix the
        # loop retried at once (over a million failures in 4 s)
        assert 0 < publisher.failed < 100, publisher.failed
        # the publisher thread did not spin: its CPU time while failing is a small share of
        # the time the training thread used (pre-fix it took a whole core)
        spent = publisher.cpu_at_failure[-1] - publisher.cpu_at_failure[0]
        assert spent < 0.1 * max(training_cpu, 1.0), (spent, training_cpu)
        assert steps > 0

        # the page: the faults and the steps taken, although no snapshot could be built
        errors = errors_by_part(page)
        assert errors["publisher"] >= 1 and sum(errors.values()) == errors["publisher"]
        assert samples(page, "hookprof_steps", "hookprof_steps_total") == {
            RANK0: float(failing_steps)
        }
        assert samples(page, "hookprof_publisher_thread_up") == {RANK0: 0.0}

        # recovery: the next build that succeeds publishes, the thread is up again
        publisher.failing.clear()
        assert prof.flush()
        assert prof.snapshot().step == failing_steps
        recovered = parse(scrape(prof.url))
        assert samples(recovered, "hookprof_publisher_thread_up") == {RANK0: 1.0}
        assert samples(recovered, "hookprof_steps", "hookprof_steps_total") == {
            RANK0: float(failing_steps)
        }
        assert errors_by_part(recovered)["publisher"] >= 1


def test_detach_while_the_snapshot_build_fails_stops_the_publisher_at_once():
    FailingBuild.made.clear()
    model = seeded(MixedNet)
    config = hookprof.Config(
        port=0, sample_every=1, min_sample_interval_s=0.0, summary_at_exit=False
    )
    prof = hookprof.Profiler(model, config, publisher=FailingBuild)
    publisher = FailingBuild.made[0]
    try:
        train(model, 3)
        publisher.failing.set()
        train(model, 3)
    finally:
        started = time.monotonic()
        prof.detach()
        took = time.monotonic() - started
    # pre-fix the last publish's failure kept the loop going: stop() waited its 10 s out
    # and left the thread running
    assert not publisher.alive
    assert took < 3.0, took
