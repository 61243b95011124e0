"""DESIGN.md invariant 3: an internal failure is counted, logged once, switches the hooks
off, and never reaches the training loop."""

from __future__ import annotations

import logging

import torch

import hookprof
from conftest import parse, samples, scrape
from models import MixedNet, seeded, train


def test_failure_inside_a_hook_is_counted_and_training_is_unchanged(caplog):
    reference = seeded(MixedNet)
    train(reference, 12)

    model = seeded(MixedNet)
    prof = hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0)
    real_mark = prof.timer.mark
    calls = {"n": 0}

    def failing_mark():
        calls["n"] += 1
        if calls["n"] == 10 and prof._counters.steps == 0:  # inside the first step's hooks
            raise RuntimeError("injected failure")
        return real_mark()

    prof.timer.mark = failing_mark
    with caplog.at_level(logging.ERROR, logger="hookprof"):
        train(model, 12, prof=prof, explicit_step=True)
    prof.flush()
    snap = prof.snapshot()
    text = scrape(prof.url)
    prof.detach()

    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert snap.internal_errors == 1
    assert snap.step == 12  # steps are still counted
    assert snap.sampled_steps == 0  # the broken step and every later one are not samples
    assert samples(parse(text), "hookprof_internal_errors", "hookprof_internal_errors_total") == {
        frozenset({"rank": "0"}.items()): 1
    }
    records = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(records) == 1 and "injected failure" in caplog.text


def test_failure_in_the_publisher_thread_is_counted_and_it_keeps_running(monkeypatch):
    model = seeded(MixedNet)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        aggregator = prof._publisher._aggregator
        real_fold = aggregator.fold
        state = {"failed": False}

        def fold_failing_once(packet, timer):
            if not state["failed"]:
                state["failed"] = True
                raise ValueError("injected fold failure")
            return real_fold(packet, timer)

        monkeypatch.setattr(aggregator, "fold", fold_failing_once)
        train(model, 3)
        prof.flush()
        snap = prof.snapshot()
        assert prof._publisher.alive
    assert snap.internal_errors == 1
    assert snap.step == 3 and snap.sampled_steps == 2  # the failed sample is lost, no more
