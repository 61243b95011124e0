"""Bad input: a clear error, and nothing half-attached afterwards."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

import hookprof
from support.hooks_left import global_hook_counts, hookprof_threads, model_state
from support.models import DeepNet, seeded, train
from support.ports import free_port


def assert_nothing_attached(model, before, globals_before):
    assert model_state(model) == before
    assert global_hook_counts() == globals_before
    assert hookprof_threads() == []


@pytest.mark.parametrize("thing", [None, "model", torch.zeros(3), nn.Linear])
def test_attaching_a_non_module(thing):
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got"):
        hookprof.attach(thing)


def test_model_without_parameters():
    with pytest.raises(ValueError, match="Sequential has no parameters"):
        hookprof.attach(nn.Sequential(nn.ReLU()), port=0)


def test_invalid_config_leaves_nothing():
    model = seeded(DeepNet)
    before, globals_before = model_state(model), global_hook_counts()
    with pytest.raises(hookprof.ConfigError, match="sample_every must be >= 1, got -2"):
        hookprof.attach(model, sample_every=-2)
    with pytest.raises(TypeError, match="config must be a hookprof.Config"):
        hookprof.attach(model, config={"port": 0})
    assert_nothing_attached(model, before, globals_before)


def test_port_in_use_names_port_and_setting():
    model = seeded(DeepNet)
    before, globals_before = model_state(model), global_hook_counts()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(hookprof.PortInUseError) as info:
            hookprof.attach(model, port=port, port_conflict="raise")
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "HOOKPROF_PORT" in message and "port=" in message
    assert info.value.port == port
    assert_nothing_attached(model, before, globals_before)


def test_a_port_this_process_serves_on_another_address_names_the_holder():
    port = free_port()
    first_model, second_model = seeded(DeepNet), seeded(DeepNet)
    with hookprof.attach(first_model, port=port, addr="0.0.0.0"):
        before = model_state(second_model)
        with pytest.raises(hookprof.PortInUseError, match=str(port)) as info:
            hookprof.attach(
                second_model, port=port, port_conflict="raise"
            )  # 127.0.0.1: taken by us
        assert model_state(second_model) == before
    # issue 11 case 6: the message says who holds it and what releases it
    assert info.value.holder == "DeepNet"
    assert "earlier hookprof profiler in this process" in str(info.value)
    assert "hookprof.detach_all()" in str(info.value)


def test_settings_that_differ_from_the_endpoint_a_model_joins_are_refused():
    port = free_port()
    first = seeded(DeepNet)  # held: a profiler whose model is gone is released at attach
    with hookprof.attach(first, port=port):
        second = seeded(DeepNet)
        with pytest.raises(hookprof.ConfigError, match="http_max_requests"):
            hookprof.attach(second, port=port, http_max_requests=7)


def test_a_notebook_cell_run_twice_is_told_and_released_by_detach_all(caplog):
    import logging

    port = free_port()
    models = [seeded(DeepNet), seeded(DeepNet)]  # both still referenced (e.g. by Out[] history)
    first = hookprof.attach(models[0], port=port)  # the cell's first run
    with caplog.at_level(logging.INFO, logger="hookprof"):
        second = hookprof.attach(models[1], port=port)  # run again: served beside it
    assert second.name == "DeepNet-2" and second.url == first.url
    said = [r.getMessage() for r in caplog.records if "another DeepNet" in r.getMessage()]
    assert len(said) == 1 and "hookprof.detach_all()" in said[0]
    second.flush()
    assert any("another DeepNet" in n for n in second.snapshot().notices)
    assert hookprof.detach_all() == 2 and first.detached and second.detached
    with hookprof.attach(seeded(DeepNet), port=port) as again:
        assert again.port == port and again.name == "DeepNet"  # the name is free again


def run_notebook_cell(port: int, steps: int = 3) -> hookprof.Profiler:
    """What a notebook cell does: build, attach, train; the cell's names are rebound by the
    caller (`model`, `opt` and `prof` live only in this frame, like a re-run cell's)."""
    model = seeded(DeepNet)
    prof = hookprof.attach(model, port=port, sample_every=1, min_sample_interval_s=0.0)
    train(model, steps)
    return prof


@pytest.mark.parametrize("fixed_port", [True, False], ids=["same port", "port 0"])
def test_a_notebook_cell_run_again_releases_the_profiler_whose_model_is_gone(caplog, fixed_port):
    """Issue 11 case 6: the earlier cell's model is gone (its name was rebound), so the
    next attach releases its profiler: the port, the threads and the global hooks come back,
    and the model label is the same as before (its dashboards' series go on)."""
    import logging

    globals_before = global_hook_counts()
    port = free_port() if fixed_port else 0
    prof = run_notebook_cell(port)
    threads_once = sorted(hookprof_threads())
    hooks_once = global_hook_counts()
    for _ in range(3):  # the cell, run three more times
        earlier = prof
        with caplog.at_level(logging.INFO, logger="hookprof"):
            prof = run_notebook_cell(port)
        assert earlier.detached and earlier.model is None
        assert not prof.detached and prof.name == "DeepNet"  # the same label as the first run
        if fixed_port:
            assert prof.port == port
        assert sorted(hookprof_threads()) == threads_once  # not one more thread per run
        assert global_hook_counts() == hooks_once
    released = [r.getMessage() for r in caplog.records if "its model is gone" in r.getMessage()]
    assert len(released) == 3 and "DeepNet" in released[0]
    assert prof.steps == 3  # the live profiler counts its own steps only
    prof.detach()
    assert global_hook_counts() == globals_before and hookprof_threads() == []


def test_an_earlier_profiler_whose_model_is_alive_is_not_released():
    port = free_port()
    kept = seeded(DeepNet)  # the earlier model is still referenced: never released
    first = hookprof.attach(kept, port=port)
    second = hookprof.attach(seeded(DeepNet), port=port)
    try:
        assert not first.detached and first.model is kept
        assert second.name == "DeepNet-2"
    finally:
        hookprof.detach_all()


def test_attaching_twice_names_the_existing_profiler():
    model = seeded(DeepNet)
    with hookprof.attach(model, port=0) as prof:
        with pytest.raises(hookprof.AlreadyAttachedError) as info:
            hookprof.attach(model, port=0)
        assert info.value.profiler is prof
        assert prof.url in str(info.value)
        with pytest.raises(hookprof.AlreadyAttachedError):
            hookprof.attach(model.blocks[0], port=0)  # a part of it counts too
    with hookprof.attach(model, port=0):  # and after detach it works
        pass


def test_step_after_detach():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, port=0)
    prof.detach()
    with pytest.raises(hookprof.DetachedError, match="after detach"):
        prof.step()
    train(model, 2)  # training without the profiler is unaffected
