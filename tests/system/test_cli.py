"""The `hookprof` command as a user runs it: a real process, a real scrape."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import hookprof
from support.metrics import parse, samples, scrape
from support.ports import free_port
from support.processes import hookprof_cmd, read_until


def test_version():
    out = subprocess.run(hookprof_cmd("--version"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"hookprof {hookprof.__version__}"


def test_demo_serves_live_metrics_and_reports_an_injected_nan():
    port = free_port()
    proc = subprocess.Popen(
        hookprof_cmd(
            "demo",
            "--port",
            str(port),
            "--steps",
            "100000",
            "--nan-at-step",
            "30",
            "--nan-layer",
            "mlp.0",
            "--step-delay",
            "0.002",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = read_until(proc.stdout, "serving metrics at")
        assert f"serving metrics at http://127.0.0.1:{port}/metrics" in line, line
        url = re.search(r"(http://\S+)", line).group(1)
        deadline = time.monotonic() + 60
        while True:
            f = parse(scrape(url))
            first = samples(f, "hookprof_first_nonfinite_info")
            if first or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        steps = samples(f, "hookprof_steps", "hookprof_steps_total")[
            frozenset({"rank": "0"}.items())
        ]
        assert steps >= 30
        assert list(first) == [
            frozenset({"rank": "0", "layer": "mlp.0", "phase": "forward", "step": "30"}.items())
        ]
        layers = {
            dict(k)["layer"]
            for k in samples(
                f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count"
            )
        }
        assert {"embed", "attn", "norm", "mlp.0", "mlp.1", "mlp.2", "head"} <= layers
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert "stopped after" in out


def test_demo_with_a_step_limit_and_exit_exits_by_itself():
    out = subprocess.run(
        hookprof_cmd("demo", "--port", "0", "--steps", "20", "--exit"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "stopped after 20 steps" in out.stdout
    assert "still serving" not in out.stdout


def test_demo_diagnoses_the_nan_prints_the_table_and_serves_until_ctrl_c():
    port = free_port()
    proc = subprocess.Popen(
        hookprof_cmd(
            "demo",
            "--port",
            str(port),
            "--steps",
            "30",
            "--nan-at-step",
            "20",
            "--nan-layer",
            "mlp.2",
            "--sample-every",
            "1",
            "--min-sample-interval",
            "0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )
    try:
        # hookprof's one-line diagnosis, as the NaN arrives (before the run ends)
        line = read_until(proc.stdout, "hookprof: NaN/Inf")
        assert line.startswith(
            "hookprof: NaN/Inf in the forward phase at step 20 on rank 0, first in layer mlp.2"
        ), line
        printed = []
        while "still serving metrics" not in (printed or [""])[-1]:
            printed.append(proc.stdout.readline())
            assert printed[-1], "the demo stopped before saying it serves on"
        table = [ln for ln in printed if ln.startswith(("rank 0", "mlp.2"))]
        assert table[0].startswith("rank 0  model DemoNet  step 30 (30 sampled)"), printed
        assert table[1].split()[:2] == ["mlp.2", "Linear"] and "first" in table[1].split()
        # the run is over and its figures stay up to be read
        first = samples(
            parse(scrape(f"http://127.0.0.1:{port}/metrics")),
            "hookprof_steps",
            "hookprof_steps_total",
        )
        time.sleep(1.0)
        later = samples(
            parse(scrape(f"http://127.0.0.1:{port}/metrics")),
            "hookprof_steps",
            "hookprof_steps_total",
        )
        assert first == later == {frozenset({("rank", "0")}): 30.0}
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "hookprof summary (DemoNet, rank 0): 30 steps, 30 sampled" in out
    assert "first: mlp.2 (forward) at step 20" in out
    assert out.rstrip().endswith("stopped after 30 steps")


def test_demo_rejects_an_unknown_layer():
    out = subprocess.run(
        hookprof_cmd("demo", "--port", "0", "--nan-at-step", "3", "--nan-layer", "nope"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "no module named 'nope'" in out.stderr
