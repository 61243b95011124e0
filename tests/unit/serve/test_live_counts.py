"""The fault counter and the step count go out from Faults and StepCounters, not only from
the snapshot: a snapshot that cannot be rendered (or is stale) leaves neither invisible."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from hookprof.faults import PARTS, Backoff, Faults
from hookprof.serve.exporter import SnapshotCollector
from hookprof.step.record import StepCounters
from support.metrics import errors_by_part, parse, samples

RANK3 = frozenset({"rank": "3"}.items())


def test_a_snapshot_that_cannot_be_rendered_still_shows_the_faults_and_the_steps():
    faults, counters = Faults(), StepCounters()
    for _ in range(7):
        counters.observe(0.01, 1.0)
    faults.report("snapshot build", RuntimeError("injected"), disable=False)

    def broken():
        raise RuntimeError("injected")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        SnapshotCollector(broken, "9.9", lambda: False, rank=3, faults=faults, counters=counters)
    )
    f = parse(generate_latest(registry).decode())
    assert samples(f, "hookprof_steps", "hookprof_steps_total") == {RANK3: 7.0}
    assert errors_by_part(f, "3") == {**dict.fromkeys(PARTS, 0.0), "publisher": 1.0}
    assert samples(f, "hookprof_publisher_thread_up") == {RANK3: 0.0}


def test_backoff_doubles_to_its_cap_and_a_success_starts_over():
    now = [100.0]
    backoff = Backoff(first_s=0.05, cap_s=5.0, clock=lambda: now[0])
    assert backoff.ready() and not backoff.failing
    delays = [backoff.failed() for _ in range(10)]
    assert delays[:4] == [0.05, 0.1, 0.2, 0.4] and delays[-1] == 5.0 and max(delays) == 5.0
    assert not backoff.ready()
    now[0] += 4.99
    assert not backoff.ready()
    now[0] += 0.02
    assert backoff.ready() and backoff.failing
    backoff.succeeded()
    assert not backoff.failing and backoff.failed() == 0.05
