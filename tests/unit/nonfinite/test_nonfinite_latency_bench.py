"""bench/nonfinite_latency.py on the CPU, where every copy is done when issued: under "skip" the
producer is named at the bad step's own boundary and its update held back; under "raise" the
bad step's boundary raises naming it, before the update; under "record" the weights take the
NaN (training is never changed) and flush() brings the producer into the snapshot. The same
script is the GPU measurement (bench/gpu_session.sh integrity)."""

from __future__ import annotations

import sys

import pytest
import torch

from support.paths import BENCH

sys.path.insert(0, BENCH)

import nonfinite_latency as bench  # noqa: E402

CPU = torch.device("cpu")
# sampled at step 1 only, however slow a loaded machine makes the steps: step 23 is unsampled
RARELY = {**bench.SETTINGS, "sample_every": 1000, "min_sample_interval_s": 3600.0}


def run(policy: str) -> dict:
    overrides = dict(bench.POLICIES)[policy]
    return bench.one_policy(
        policy, overrides, CPU, full=False, after=3, deadline_s=0.0, settings=RARELY
    )


def test_skip_names_the_producer_at_the_bad_steps_boundary_and_holds_its_update_back():
    r = run("skip")
    assert (r["detected"], r["named"]) == (0, 0)
    assert r["event"] == f"forward, step {bench.BAD_STEP}"
    assert r["held_back"] == 1 and r["weights_finite"]


@pytest.mark.parametrize("policy", ["raise", "raise, nonfinite_sync"])
def test_raise_stops_at_the_bad_step_before_its_update(policy):
    r = run(policy)
    assert (r["raised"], r["raised_layer"]) == (0, bench.PRODUCER)
    assert r["weights_finite"]


def test_record_changes_nothing_and_flush_names_the_producer():
    r = run("record")
    assert r["raised"] is None and r["held_back"] == 0
    assert not r["weights_finite"]  # the NaN update went in: "record" never changes training
    assert r["after_flush"] == f"{bench.PRODUCER}, forward, step {bench.BAD_STEP}"
