"""DESIGN.md invariant 4: detach() restores the model exactly and frees the port.

One thing stays in the process after the last detach, by invariant 10: the dispatcher's
optimizer step pre- and post-hook (step/dispatch.py), one each, registered at the first
attach and never removed, because torch's Optimizer.step iterates those dicts without a lock
and removing a hook while any thread steps breaks that step. With no profiler live they
call nothing: the test checks that they are inert and that nothing else is left."""

from __future__ import annotations

import torch

import hookprof
from hookprof.step import dispatch
from support.hooks_left import (
    dispatcher_hook_counts,
    foreign_global_hook_counts,
    gradscaler_step_decider,
    hookprof_threads,
    model_state,
)
from support.metrics import scrape
from support.models import MixedNet, seeded, train
from support.ports import free_port, port_is_free


def test_detach_leaves_nothing_behind():
    model = seeded(MixedNet)
    before = model_state(model)
    globals_before = foreign_global_hook_counts()
    scaler_decides = gradscaler_step_decider()
    port = free_port()
    prof = hookprof.attach(model, port=port, sample_every=2, min_sample_interval_s=0.0)
    assert not port_is_free(port)
    assert dispatcher_hook_counts() == [0, 0, 0, 0, 1, 1]  # one pre- and one post-hook
    assert dispatch.listeners() == (1, 1)  # the boundary (pre, post); the GradScaler watch: none
    assert dispatch.deciding == {}  # (filled only while a GradScaler decides a step)
    assert gradscaler_step_decider() is not scaler_decides  # watched while attached
    assert hookprof_threads()
    train(model, 5)  # ends on an unsampled step ...
    model(model.batch(torch.Generator())[0])  # ... and a sampled one left half-done
    prof.detach()

    assert model_state(model) == before
    assert foreign_global_hook_counts() == globals_before
    assert dispatcher_hook_counts() == [0, 0, 0, 0, 1, 1]  # the inert pair: calls nothing
    assert dispatch.listeners() == (0, 0)
    assert dispatch.deciding == {}
    assert gradscaler_step_decider() is scaler_decides  # torch's own method again
    assert port_is_free(port)
    assert hookprof_threads() == []
    assert prof.detached
    prof.detach()  # idempotent

    # attaching again works, on the same port
    with hookprof.attach(model, port=port) as again:
        train(model, 2)
        again.flush()
        assert again.snapshot().step == 2
        assert 'hookprof_steps_total{model="MixedNet",rank="0"} 2.0' in scrape(again.url)
    assert model_state(model) == before


def test_context_manager_detaches_on_error():
    model = seeded(MixedNet)
    before = model_state(model)
    try:
        with hookprof.attach(model, port=0):
            raise KeyError("boom")
    except KeyError:
        pass
    assert model_state(model) == before
    assert hookprof_threads() == []


def test_snapshot_still_readable_after_detach():
    model = seeded(MixedNet)
    prof = hookprof.attach(model, port=0)
    train(model, 3)
    prof.detach()
    assert prof.snapshot().step == 3  # detach publishes the final state
