"""Issue 13 on a real GPU (skipped without CUDA): the benchmark loops never sync, the op
count per unsampled step does not grow with the model on the real CUDA path, and CUDA
event timings resolve with one wait."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import hookprof
from hookprof.device.timing import CudaEventTimer
from support.cuda import no_sync
from support.op_counter import host_cost_of_unsampled_step
from support.paths import BENCH

sys.path.insert(0, BENCH)
import shapes  # noqa: E402

pytestmark = pytest.mark.cuda

CONFIGS = {
    "default": {},
    "loss check": {"nonfinite_check": "loss"},
    "every step": {"sample_every": 1, "min_sample_interval_s": 0.0, "activation_interval_s": 0.0},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", shapes.NAMES)
def test_benchmark_loops_never_sync(name, config):
    """bench/overhead.py --gpu's training loops (narrow sizes: syncs do not depend on width),
    with hookprof attached, under torch.cuda.set_sync_debug_mode("error")."""
    if name == "hf-gpt2" and not shapes.hf_available():
        pytest.skip("transformers is not importable")
    shape = shapes.build(name, torch.device("cuda"), full=False)
    shape.step()  # cuBLAS/cuDNN set-up, outside the check
    try:  # the loop alone first: a sync of torch's (or transformers') own is not hookprof's
        with no_sync(drain_first=True):
            shape.step()
    except RuntimeError as exc:
        pytest.skip(
            f"{name}'s training step syncs without hookprof attached, so it cannot "
            f"show whether hookprof adds one: {exc}"
        )
    prof = hookprof.attach(shape.model, port=0, **CONFIGS[config])
    try:
        shape.step()  # attach-time work (pinned index copies) happens once, outside the check
        with no_sync(drain_first=True):
            for _ in range(6):
                shape.step()
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert snap.step == 7
    assert snap.internal_errors == 0
    assert snap.sampled_steps >= 1 and math.isfinite(snap.grad_norm)


def test_an_unsampled_step_on_cuda_costs_the_same_whatever_the_model():
    """tests/unit/step/test_host_cost.py on the real CUDA path: ops, output tensors and
    Python calls of an unsampled step equal for 4 and 400 parameters."""
    small = host_cost_of_unsampled_step(depth=0, device="cuda", lag=None)
    large = host_cost_of_unsampled_step(depth=198, device="cuda", lag=None)
    assert small.ops["aten._chunk_cat.default"] == 1
    assert (large.ops, large.tensors, large.calls) == (small.ops, small.tensors, small.calls)


def test_event_timer_resolves_a_step_with_real_events():
    timer = CudaEventTimer()
    x = torch.randn(1024, 1024, device="cuda")
    ref = timer.start()
    tokens = []
    for _ in range(5):
        x = x @ x
        x = x / x.norm()
        tokens.append(timer.mark())
    times = timer.resolve(ref, [ref, *tokens])
    assert times[ref] == 0.0
    values = [times[t] for t in tokens]
    assert values == sorted(values) and values[0] > 0
    for t in tokens:  # the same as one event pair at a time
        assert times[t] == pytest.approx(ref.elapsed_time(t) * 1e-3)
