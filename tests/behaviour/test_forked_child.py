"""A forked child that trains (issue 39, item 7): fork copies the calling thread only, so the
child has none of hookprof's threads. That is no death: the child starts them again without
counting internal errors, says so once (and that it does not serve the parent's endpoint),
and counts its own steps; the parent is untouched."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import pytest
import torch
from torch import nn

import hookprof

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "darwin", reason="os.fork"
)


def test_a_forked_child_that_trains_restarts_quietly_and_says_so(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(n):
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()

    prof = hookprof.attach(
        model, port=0, summary_at_exit=False, sample_every=1, min_sample_interval_s=0.5
    )
    try:
        train(3)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave without running pytest's teardown
            try:
                said = []
                handler = logging.Handler()
                handler.emit = lambda record: said.append(record.getMessage())
                logging.getLogger("hookprof").addHandler(handler)
                deadline = time.monotonic() + 6.0  # past the supervisor's 5 s check
                while time.monotonic() < deadline:
                    train(10)
                    time.sleep(0.05)
                prof.flush()
                snap = prof.snapshot()
                result = {
                    "steps": snap.step,
                    "errors": snap.internal_errors,
                    "said": said,
                    "notices": list(snap.notices),
                }
            except BaseException as exc:  # anything: reported to the parent
                result = {"error": repr(exc)}
            os.write(write, json.dumps(result).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            child = json.loads(f.read())
        assert status == 0 and "error" not in child, child
        assert child["errors"] == 0, child
        assert child["steps"] > 3
        forked = [n for n in child["notices"] if "is a fork of" in n]
        assert (
            len(forked) == 1
            and "does not serve" in forked[0]
            and f"fork of {os.getpid()}" in forked[0]
        )
        assert not any("thread died" in line for line in child["said"])
        # the parent: its threads and its endpoint as they were
        train(2)
        prof.flush()
        assert prof.snapshot().internal_errors == 0 and prof.snapshot().step == 5
        assert not any("is a fork of" in n for n in prof.snapshot().notices)
    finally:
        prof.detach()
