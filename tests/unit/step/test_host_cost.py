"""hookprof's host work per unsampled step must not grow with the model (issue 13).

Timing is for bench/host_cost.py; what a test can hold without a clock is the number of
ATen ops hookprof issues per unsampled step, each one a kernel launch on a GPU. They are
counted with a TorchDispatchMode around one whole training step, with and without hookprof
on copies of the same model: the difference is hookprof's. The gradient reduction runs its
accelerator path here (`GradientNorms.cpu_dot_per_tensor = False`): on a CPU it otherwise
takes one BLAS dot per gradient, which is right for a CPU and is not what a GPU runs.
"""

from __future__ import annotations

import math

import pytest
import torch

import hookprof
from hookprof import NonFiniteEvent
from hookprof.step.gradients import GradientNorms
from support.models import DeepNet, layer_norms, loss_of, seeded
from support.op_counter import hookprof_ops_per_unsampled_step, one_step
from support.settings import RARELY


@pytest.fixture
def accelerator_path(monkeypatch):
    monkeypatch.setattr(GradientNorms, "cpu_dot_per_tensor", False)


def test_ops_per_unsampled_step_do_not_grow_with_parameters(accelerator_path):
    small = hookprof_ops_per_unsampled_step(depth=0)  # stem + head: 4 parameters
    large = hookprof_ops_per_unsampled_step(depth=198)  # 400 parameters, 398 layers
    assert sum(p.numel() > 0 for p in seeded(DeepNet, depth=198).parameters()) == 400
    # the every-step check is there (one fused read of every gradient) ...
    assert small["aten._foreach_norm.Scalar"] == 1
    assert small["aten.index_add_.default"] == 1
    # ... and costs the same number of ops, op for op, on a model 100x the size
    assert large == small
    assert sum(small.values()) <= 40, small


def test_cpu_path_issues_one_dot_per_gradient():
    """The CPU path is per gradient by design (compute, not launches): the counter sees it,
    so the test above would see such a path on the accelerator."""
    small = hookprof_ops_per_unsampled_step(depth=0)
    large = hookprof_ops_per_unsampled_step(depth=10)
    assert small["aten.dot.default"] == 4 and large["aten.dot.default"] == 24


@pytest.mark.parametrize("set_to_none", [True, False], ids=["new-grads", "same-grads"])
def test_accelerator_path_norms_are_exact(accelerator_path, set_to_none):
    """Per-layer norms from the fused path, on every step, against float64 norms computed
    apart; also after a layer stops getting gradients (the cached plan changes)."""
    model = seeded(DeepNet)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        for step in range(1, 7):
            if step == 4:  # freeze a layer: its parameters keep no gradient from now on
                for p in model.blocks[2].fc.parameters():
                    p.requires_grad_(False)
                    p.grad = None
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(model, model.batch(g)).backward()
            opt.step()
            prof.flush()
            snap = prof.snapshot()
            expected = layer_norms(model)
            got = {n: s.grad_norm for n, s in snap.layers.items() if s.grad_norm is not None}
            if step >= 4:
                assert "blocks.2.fc" not in expected
                # a layer without a gradient this step shows its last norm, not a new one
                got.pop("blocks.2.fc", None)
            assert set(got) == set(expected), step
            for name, value in expected.items():
                assert got[name] == pytest.approx(value, rel=1e-5), (step, name)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_accelerator_path_finds_the_first_bad_step_exactly(accelerator_path, value):
    """Every-step guarantees on the fused path: a non-finite gradient on an unsampled step is
    counted for its layer, at that step, once."""
    model = seeded(DeepNet)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    prof = hookprof.attach(model, **RARELY)
    try:
        for step in range(1, 8):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, model.batch(g))
            loss.backward()
            if step in (5, 7):
                model.blocks[3].fc.weight.grad[0, 0] = value
            else:  # no update from a bad gradient: the next step's gradients are finite
                opt.step()
            prof.step(loss)
    finally:
        prof.detach()
    snap = prof.snapshot()
    assert snap.first_nonfinite == NonFiniteEvent("blocks.3.fc", "backward", 5, found_by="backward check")
    assert snap.nonfinite_steps["backward"] == 2
    assert snap.layers["blocks.3.fc"].nonfinite["backward"] == 2
    assert sum(s.nonfinite["backward"] for s in snap.layers.values()) == 2
    assert all(math.isfinite(s.grad_norm) for n, s in snap.layers.items()
               if s.grad_norm is not None and n != "blocks.3.fc")
