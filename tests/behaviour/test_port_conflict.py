"""A metrics port another process holds (issue 32): training goes on. One log error names the
port and the process holding it; by default metrics are served on a free port (the log says
which, and that page exports that it happened), with port_conflict="off" not at all, and with
"raise" attach raises PortInUseError as before (test_errors.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

import hookprof
from hookprof.serve.port_conflict import port_holder
from support.metrics import parse, samples, scrape
from support.models import DeepNet, seeded, train
from support.ports import free_port

HOLDER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.read()  # holds the port until the test closes stdin
""")
HOLDER_COMMAND = " ".join([sys.executable, "-c", *HOLDER.split()])  # as the holder is named


@pytest.fixture
def held_port():
    """(port, pid): a port another process listens on, as a user's other server would."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "hold-port"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield int(proc.stdout.readline()), proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def conflict_errors(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "cannot serve metrics" in r.getMessage()
    ]


def test_the_holder_is_found_from_proc(held_port):
    port, pid = held_port
    # the command line on one line, whitespace collapsed, cut at 80 characters
    assert port_holder(port) == f"pid {pid} ({HOLDER_COMMAND[:77]}...)"
    assert port_holder(free_port()) is None


def test_a_taken_port_serves_on_a_free_one_and_says_so(held_port, caplog):
    port, pid = held_port
    caplog.set_level(logging.ERROR, logger="hookprof")
    model = seeded(DeepNet)
    with hookprof.attach(model, port=port, sample_every=1, min_sample_interval_s=0.0) as prof:
        train(model, 3, prof=None)
        served = prof.port
        assert served not in (None, port)
        # a second model asking for the same port joins the endpoint that stands in for it
        other = seeded(DeepNet)
        with hookprof.attach(other, port=port) as second:
            assert second.url == prof.url
        prof.flush()
        page = parse(scrape(prof.url))
    (message,) = conflict_errors(caplog)
    assert f"127.0.0.1:{port}" in message and f"held by pid {pid} " in message
    assert f"serving metrics on 127.0.0.1:{served} instead" in message
    assert 'port_conflict="raise"' in message
    (labels,) = samples(page, "hookprof_metrics_port_conflict_info", model=None)
    assert dict(labels)["wanted_port"] == str(port) and dict(labels)["holder"] == f"pid {pid}"
    assert samples(page, "hookprof_steps", "hookprof_steps_total") == {
        frozenset({("rank", "0")}): 3
    }


def test_off_serves_nothing_and_training_goes_on(held_port, caplog):
    port, pid = held_port
    caplog.set_level(logging.ERROR, logger="hookprof")
    model = seeded(DeepNet)
    with hookprof.attach(model, port=port, port_conflict="off", sample_every=1) as prof:
        train(model, 3)
        assert prof.url is None and prof.port is None
        prof.flush()
        assert prof.snapshot().step == 3
    (message,) = conflict_errors(caplog)
    assert f"127.0.0.1:{port}, held by pid {pid} " in message
    assert 'metrics are not served (port_conflict="off")' in message


def test_raise_keeps_the_error(held_port):
    port, _ = held_port
    with pytest.raises(hookprof.PortInUseError, match=f"127.0.0.1:{port}"):
        hookprof.attach(seeded(DeepNet), port=port, port_conflict="raise")
