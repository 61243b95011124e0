"""Faults inside hookprof: its background thread dying is detected, reported and repaired;
never silent. (A failure inside a hook is covered by test_internal_errors.py.)"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import hookprof
from hookprof import _testing
from hookprof.faults import PARTS
from hookprof.publish.publisher import Publisher
from support.metrics import errors_by_part, parse, samples, scrape
from support.models import DeepNet, seeded, train


def up(prof) -> float:
    return samples(parse(scrape(prof.url)), "hookprof_publisher_thread_up")[
        frozenset({"rank": "0"}.items())
    ]


# pytest reports a thread's uncaught exception as a warning: here it is the point
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class DyingPublisher(Publisher):
    """A publisher whose thread is killed by the sampled packet of step `die_at` (or by every
    fold from the `die_from`th on): SystemExit, stronger than the Exception its loop catches."""

    die_at: int | None = None
    die_from: int | None = None
    instances: list[DyingPublisher] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.folds = 0
        DyingPublisher.instances = [self]

    def fold(self, packet):
        self.folds += 1
        if (packet.sampled and packet.step == self.die_at) or (
            self.die_from is not None and self.folds >= self.die_from
        ):
            raise SystemExit("something stronger than an Exception")  # ends a thread quietly
        super().fold(packet)


def attach_dying(model, every_step, **dying):
    publisher = type("Dying", (DyingPublisher,), dying)
    prof = hookprof.Profiler(model, hookprof.Config(**every_step), publisher=publisher)
    return prof, publisher.instances[0]


def test_publisher_thread_death_is_reported_and_the_thread_restarted(caplog, every_step):
    reference = seeded(DeepNet)
    train(reference, 2)  # the same calls as below (each makes its own optimizer and batches)
    train(reference, 8)
    model = seeded(DeepNet)
    prof, publisher = attach_dying(model, every_step, die_at=2)
    try:
        assert up(prof) == 1.0
        train(model, 2, prof=prof, explicit_step=True)  # the step-2 packet kills the thread
        deadline = time.monotonic() + 10
        while publisher.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not publisher.alive
        assert up(prof) == 0.0  # visible at once in the scrape

        with caplog.at_level(logging.ERROR, logger="hookprof"):
            train(model, 8, prof=prof, explicit_step=True)  # the next step notices
            prof.flush()
        assert publisher.alive and up(prof) == 1.0
        assert any("publisher thread" in r.getMessage() for r in caplog.records)
        snap = prof.snapshot()
        assert snap.internal_errors == 1
        assert snap.step == 10  # step counts are host counters, not lost with the thread
        f = parse(scrape(prof.url))
        assert (
            samples(f, "hookprof_steps", "hookprof_steps_total")[frozenset({"rank": "0"}.items())]
            == 10
        )
    finally:
        prof.detach()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)  # training itself never noticed


def test_a_thread_that_keeps_dying_is_restarted_a_few_times_then_left_reported(caplog, every_step):
    from hookprof.faults import MAX_RESTARTS as MAX_PUBLISHER_RESTARTS

    model = seeded(DeepNet)
    prof, publisher = attach_dying(model, every_step, die_from=1)
    try:
        with caplog.at_level(logging.ERROR, logger="hookprof"):
            for _ in range(MAX_PUBLISHER_RESTARTS + 3):
                train(model, 1, prof=prof, explicit_step=True)
                deadline = time.monotonic() + 10
                while publisher.alive and time.monotonic() < deadline:
                    time.sleep(0.01)
                train(model, 1, prof=prof, explicit_step=True)
        assert publisher.restarts == MAX_PUBLISHER_RESTARTS  # then reported, not restarted again
        assert up(prof) == 0.0
        messages = [r.getMessage() for r in caplog.records if "publisher thread" in r.getMessage()]
        assert len(messages) == MAX_PUBLISHER_RESTARTS + 1, messages
    finally:
        prof.detach()


def test_metrics_server_thread_death_is_reported_and_serving_resumes(caplog, every_step):
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **every_step)
    try:
        port = prof.port
        _testing.http_server(prof).shutdown()  # its serve_forever returns: the thread ends
        _testing.serving_thread(prof).join(5)
        assert not _testing.metrics_server(prof).alive
        with caplog.at_level(logging.ERROR, logger="hookprof"):
            train(model, 2, prof=prof, explicit_step=True)  # the next step notices
            prof.flush()
        assert _testing.metrics_server(prof).alive and prof.port == port  # same port, serving again
        f = parse(scrape(prof.url))
        assert (
            samples(f, "hookprof_steps", "hookprof_steps_total")[frozenset({"rank": "0"}.items())]
            == 2
        )
        assert errors_by_part(f) == {**dict.fromkeys(PARTS, 0.0), "metrics server": 1.0}
        assert any("metrics server thread" in r.getMessage() for r in caplog.records)
    finally:
        prof.detach()
