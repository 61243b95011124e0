"""A model compiled with CUDA graphs (torch.compile(mode="reduce-overhead"), issue 30), on a
GPU. What the first GPU run measured with bench/cudagraphs.py (H200, torch 2.11, 2026-11-27):
the forward NaN named as in eager mode, training bit-identical, nothing recompiled, but one
CUDA-graph skip that the run without hookprof did not have (the traced check's counters were
a mutated input); the counters are now static inputs (test_compiled_nonfinite.py checks that
on the CPU). These tests hold the whole of it on a GPU, fullgraph or not."""

from __future__ import annotations

import pytest
import torch

from support.compare import same_bits
from support.compiled import overflow_run

pytestmark = pytest.mark.cuda

BAD_STEP = 7
NET = dict(inputs=64, width=128, depth=2)


def run(fullgraph: bool, attach: bool):
    """(parameters, the first NaN/Inf, Dynamo's counts after warm-up: graph breaks, frames
    and graphs compiled, CUDA-graph skips)."""
    params, snap, dynamo = overflow_run(
        lambda model: torch.compile(model, mode="reduce-overhead", fullgraph=fullgraph),
        attach=attach,
        device="cuda",
        net=NET,
        batch=128,
        steps=10,
        bad_step=BAD_STEP,
        settings=dict(port=0, summary_at_exit=False),
    )
    if snap is not None:
        assert snap.internal_errors == 0
    return params, snap.first_nonfinite if snap is not None else None, dynamo


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
def test_reduce_overhead_names_the_forward_nan_and_keeps_every_cuda_graph(fullgraph):
    plain, _, plain_dynamo = run(fullgraph, attach=False)
    params, event, dynamo = run(fullgraph, attach=True)
    assert (event.layer, event.phase, event.step, event.replay) == (
        "inp",
        "forward",
        BAD_STEP,
        "reproducible",
    )
    assert dynamo == plain_dynamo  # graph breaks, recompiles after warm-up, CUDA-graph skips
    assert same_bits(plain, params)
