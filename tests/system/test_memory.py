"""5,000 steps at hookprof's most active setting (bench/memory.py, run as a process): after
warm-up, live tensors and Python objects do not grow, nor does resident memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.paths import BENCH


@pytest.mark.slow
def test_5000_steps_leave_memory_flat():
    # one torch thread: this counts memory, not speed, and OpenMP's spinning threads on a
    # loaded 2-core machine made the run 10x slower (280 s of CPU for a 28 s run)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, os.path.join(BENCH, "memory.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        "\n"
        + "\n".join(
            f"step {r['step']}: RSS {r['rss_bytes'] / 2**20:.1f} MiB, "
            f"{r['tensors']} tensors, {r['objects']} objects"
            for r in rows
        )
    )
    assert [r["step"] for r in rows] == [500, 1000, 2000, 3000, 4000, 5000]
    assert rows[-1]["sampled"] == 5000  # every step was sampled
    settled = rows[1]
    for r in rows[2:]:
        assert r["tensors"] <= settled["tensors"], rows
        assert r["objects"] - settled["objects"] < 200, rows
        assert r["rss_bytes"] - settled["rss_bytes"] < 16 * 2**20, rows
