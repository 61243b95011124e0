"""torch.compile: hooks installed before compiling add no graph break and no recompile (counted
with torch._dynamo's counters against the same model compiled without hookprof); attaching
after compiling is detected and explained; in both cases step counts and gradient norms are
exact and training is bit-identical."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import hookprof
from support.hooks_left import forward_hooks

BACKEND = "aot_eager"  # Dynamo + AOTAutograd (forward and backward graphs), no C++ build


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))


def train(model, call, steps=6, prof=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = call(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def compiled_run(attach: str | None, settings: dict, backend: str = BACKEND):
    """attach: None (no hookprof), "before" or "after" torch.compile."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    prof = hookprof.attach(model, **settings) if attach == "before" else None
    compiled = torch.compile(model, backend=backend)
    if attach == "after":
        prof = hookprof.attach(compiled, **settings)
    try:
        train(model, compiled)
        graph_breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        snap = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
        return model, graph_breaks, graphs, snap, prof
    finally:
        if prof is not None:
            prof.detach()


def check_step_level_figures(model, snap, prof):
    assert snap.step == 6 and snap.sampled_steps == 6
    for layer in prof.table.layers:
        grads = [prof.table.params[i].grad for i in layer.param_indices]
        if grads:
            expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
            assert snap.layers[layer.name].grad_norm == pytest.approx(expected, rel=1e-5), (
                layer.name
            )
    # per-layer timing is off under compile, never wrong
    assert all(
        s.forward_calls_total == 0 and s.backward_calls_total == 0 for s in snap.layers.values()
    )


@pytest.mark.parametrize("when", ["before", "after"])
def test_compile_adds_no_graph_break_and_keeps_step_figures(when, every_step, caplog):
    reference, breaks0, graphs0, _, _ = compiled_run(None, every_step)
    with caplog.at_level(logging.INFO, logger="hookprof"):
        model, breaks, graphs, snap, prof = compiled_run(when, every_step)
    assert breaks == breaks0 == 0
    assert graphs == graphs0  # no recompile caused by hookprof either
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    check_step_level_figures(model, snap, prof)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "torch.compile" in messages or "compiled before attach" in messages
    assert "gradient norms" in messages  # says what still works
    assert len(snap.notices) == 1 and "per-layer forward/backward times" in snap.notices[0]  # kept
    if when == "after":
        assert not forward_hooks(model)  # nothing added to it


@pytest.mark.slow
def test_inductor_the_default_backend(every_step):
    """The backend users get by default (generated C++ on the CPU): ~30 s per compile here."""
    reference, breaks0, graphs0, _, _ = compiled_run(None, every_step, backend="inductor")
    model, breaks, graphs, snap, prof = compiled_run("before", every_step, backend="inductor")
    assert breaks == breaks0 == 0 and graphs == graphs0
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    check_step_level_figures(model, snap, prof)


def test_eager_after_a_compiled_model_still_times_layers(every_step):
    """The same process can profile an eager model normally (the probe is per profiler)."""
    model = make_model()
    with hookprof.attach(model, **every_step) as prof:
        train(model, model)
        prof.flush()
        snap = prof.snapshot()
    assert all(s.forward_calls_total == 6 for s in snap.layers.values())
