"""Complex parameters (issue 39, item 1): nn.Linear(dtype=torch.cfloat) under Adam. Every
step counted, gradient norms measured (the norm of a complex gradient: its real view's),
no internal error, and a NaN in a complex output or gradient found like a real one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookprof
from support.settings import EVERY_STEP, RARELY


def complex_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, dtype=torch.cfloat), nn.Linear(8, 2, dtype=torch.cfloat))


def test_complex_parameters_are_measured_and_every_step_counted():
    model = complex_model()
    prof = hookprof.attach(
        model,
        config=hookprof.Config(summary_at_exit=False, activation_interval_s=0.0, **EVERY_STEP),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(3, 4, generator=g, dtype=torch.cfloat)).abs().sum().backward()
            expected = {
                name: math.sqrt(sum(float(p.grad.abs().pow(2).sum()) for p in layer.parameters()))
                for name, layer in (("0", model[0]), ("1", model[1]))
            }
            opt.step()
        prof.flush()
        snap = prof.snapshot()
        assert snap.step == 6 and snap.internal_errors == 0
        for name, norm in expected.items():
            assert math.isclose(snap.layers[name].grad_norm, norm, rel_tol=1e-5), (name, norm)
        assert snap.first_nonfinite is None
    finally:
        prof.detach()


def nan_weight(model, step):
    if step == 3:
        with torch.no_grad():
            model[1].weight[0, 0] = complex(float("nan"), 0.0)


def inf_gradient(model, step):
    if step == 2:
        model[0].bias.grad[1] = complex(0.0, float("inf"))


@pytest.mark.parametrize(
    "before_backward, after_backward, expected",
    [
        (nan_weight, None, ("1", "forward", 3)),
        (None, inf_gradient, ("0", "backward", 2)),
    ],
    ids=["a NaN weight", "an Inf in a gradient"],
)
def test_a_nan_in_a_complex_model_is_found_and_named(before_backward, after_backward, expected):
    model = complex_model()
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(1, 6):
            opt.zero_grad()
            if before_backward is not None:
                before_backward(model, step)
            model(torch.randn(3, 4, generator=g, dtype=torch.cfloat)).abs().sum().backward()
            if after_backward is not None:
                after_backward(model, step)
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
        assert (event.layer, event.phase, event.step) == expected
        assert prof.snapshot().internal_errors == 0
    finally:
        prof.detach()
