"""DESIGN.md invariant 1: training with hookprof attached is bit-identical to without."""

from __future__ import annotations

import pytest
import torch

import hookprof
from support.models import DeepNet, MixedNet, seeded, train


def params_after(model_cls, steps: int, **attach_kwargs):
    model = seeded(model_cls)
    prof = hookprof.attach(model, **attach_kwargs) if attach_kwargs else None
    try:
        losses = train(model, steps, prof=prof, explicit_step=prof is not None)
    finally:
        if prof is not None:
            prof.detach()
    return [p.detach().clone() for p in model.parameters()], losses, prof


@pytest.mark.parametrize(
    "settings",
    [
        dict(port=0, sample_every=1, min_sample_interval_s=0.0),  # hooks on every step
        dict(port=0, sample_every=3, min_sample_interval_s=0.0),  # hooks on and off
        dict(port=0),  # defaults
    ],
    ids=["every-step", "every-3rd", "defaults"],
)
@pytest.mark.parametrize("model_cls", [MixedNet, DeepNet])
def test_bit_identical_parameters_after_20_steps(model_cls, settings):
    reference, ref_losses, _ = params_after(model_cls, 20)
    profiled, losses, prof = params_after(model_cls, 20, **settings)
    assert len(reference) == len(profiled)
    for a, b in zip(reference, profiled):
        assert torch.equal(a, b)
    assert torch.equal(torch.stack(ref_losses), torch.stack(losses))
    snap = prof.snapshot()
    assert snap.step == 20 and snap.sampled_steps >= 1
    assert snap.internal_errors == 0


def test_outputs_unchanged_in_eval_and_no_grad():
    model = seeded(MixedNet)
    tokens, _ = model.batch(torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        before = model(tokens)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        with torch.no_grad():
            during = model(tokens)
        prof.flush()
        assert prof.snapshot().step == 0  # evaluation passes are not steps
    assert torch.equal(before, during)
