"""Ctrl-C during the dump report or the incident capsule (issue 39, item 3), caught by a
notebook loop that goes on: no partial file, and the file is not lost: it is written at the
next step end (or flush()/detach()), and a log line says it was interrupted."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import hookprof
from hookprof import _testing
from hookprof.nonfinite import capsule as capsule_module
from hookprof.nonfinite import incident as incident_module
from support.first_nan import Overflow, fused_sgd, loss_of
from support.settings import RARELY


def interrupt_once(monkeypatch, module):
    """`module.write_atomic` raises KeyboardInterrupt on its first call (a Ctrl-C in the
    middle of the write); later calls write."""
    real = module.write_atomic
    calls = []

    def write(path, data, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(path, data, **kwargs)

    monkeypatch.setattr(module, "write_atomic", write)
    return calls


def notebook_loop(settings: dict, steps: int = 10):
    """Overflow(at=5)'s model trained in a loop that catches KeyboardInterrupt and goes on
    (a notebook cell re-run, a REPL); returns (prof, interrupts caught)."""
    scenario = Overflow(at=5)
    model = scenario.make_model()
    opt = fused_sgd(model)
    g = torch.Generator().manual_seed(1)
    prof = hookprof.attach(
        model,
        config=hookprof.Config(summary_at_exit=False).replace(
            **{**RARELY, **scenario.settings, **settings}
        ),
    )
    caught = 0
    for step in range(1, steps + 1):
        try:
            inputs, target = model.batch(g)
            inputs = scenario.before_step(step, model, inputs)
            opt.zero_grad(set_to_none=True)
            loss_of(model, model(inputs), target).backward()
            opt.step()
        except KeyboardInterrupt:
            caught += 1
    return prof, caught


def caught_here(body):
    """Run `body`; a KeyboardInterrupt that escapes it would end pytest's whole session."""
    try:
        return body()
    except KeyboardInterrupt:
        pytest.fail("the injected KeyboardInterrupt escaped the test's own loop")


def test_an_interrupted_dump_is_written_at_the_next_step_end(tmp_path, monkeypatch, caplog):
    calls = interrupt_once(monkeypatch, incident_module)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        prof, caught = caught_here(
            lambda: notebook_loop(dict(on_nonfinite="dump", dump_dir=str(tmp_path)))
        )
    try:
        assert caught == 1 and len(calls) == 2
        reports = list(tmp_path.glob("*.json"))
        assert len(reports) == 1 and not list(tmp_path.glob(".*.tmp"))
        assert json.loads(reports[0].read_text())["incident"]["layer"] == "fc1"
        assert any("was interrupted (KeyboardInterrupt)" in r.getMessage() for r in caplog.records)
    finally:
        prof.detach()


@pytest.mark.parametrize("policy", ["record", "warn"])
def test_an_interrupted_capsule_is_written_later(tmp_path, monkeypatch, caplog, policy):
    _testing.forget_capsules_written()
    calls = interrupt_once(monkeypatch, capsule_module)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        prof, caught = caught_here(
            lambda: notebook_loop(dict(on_nonfinite=policy, capsule_dir=str(tmp_path)))
        )
    try:
        # under record the capsule waits for flush(): the Ctrl-C lands there, and the cell
        # that called it is run again
        try:
            prof.flush()
        except KeyboardInterrupt:
            caught += 1
        caught_here(prof.flush)
        assert caught == 1 and len(calls) == 2
        capsules = list(tmp_path.glob("*.pt"))
        assert len(capsules) == 1 and not list(tmp_path.glob(".*.tmp"))
        assert prof.snapshot().first_nonfinite.capsule == str(capsules[0])
        assert any("interrupted (KeyboardInterrupt)" in r.getMessage() for r in caplog.records)
    finally:
        prof.detach()
