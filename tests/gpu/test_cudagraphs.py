"""A model compiled with CUDA graphs (torch.compile(mode="reduce-overhead"), issue 30), on a
GPU. What the first GPU run measured with bench/cudagraphs.py (H200, torch 2.11, 2026-11-27):
the forward NaN named as in eager mode, training bit-identical, nothing recompiled, but one
CUDA-graph skip that the run without hookprof did not have (the traced check's counters were
a mutated input); the counters are now static inputs (test_compiled_nonfinite.py checks that
on the CPU). These tests hold the whole of it on a GPU, fullgraph or not."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import hookprof

pytestmark = pytest.mark.cuda

BAD_STEP = 7
STEPS = 10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.act, self.out = nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1)
        with torch.no_grad():
            self.inp.weight.mul_(10)  # the bad row overflows here

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


def run(fullgraph: bool, attach: bool):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = hookprof.attach(model, port=0, summary_at_exit=False) if attach else None
    call = torch.compile(model, mode="reduce-overhead", fullgraph=fullgraph)
    gen = torch.Generator(device="cuda").manual_seed(1)
    try:
        for step in range(1, STEPS + 1):
            x = torch.randn(128, 64, device="cuda", generator=gen)
            if step == BAD_STEP:
                x[0] = 3e38
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            opt.step()
            if step == 2:
                warm = counters["frames"]["total"] + counters["stats"]["unique_graphs"]
        torch.cuda.synchronize()
        dynamo = (sum(counters["graph_break"].values()),
                  counters["frames"]["total"] + counters["stats"]["unique_graphs"] - warm,
                  counters["inductor"]["cudagraph_skips"])
        event = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
            assert snap.internal_errors == 0
            event = snap.first_nonfinite
        return [p.detach().clone() for p in model.parameters()], event, dynamo
    finally:
        if prof is not None:
            prof.detach()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
def test_reduce_overhead_names_the_forward_nan_and_keeps_every_cuda_graph(fullgraph):
    plain, _, plain_dynamo = run(fullgraph, attach=False)
    params, event, dynamo = run(fullgraph, attach=True)
    assert (event.layer, event.phase, event.step, event.replay) == ("inp", "forward", BAD_STEP, "reproducible")
    assert dynamo == plain_dynamo  # graph breaks, recompiles after warm-up, CUDA-graph skips
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, params))
