"""Mixed precision and gradient accumulation train exactly as without hookprof, with exact
figures; and the bad inputs of issue 5 that other files do not cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from support.metrics import parse, samples, scrape
from support.models import DeepNet, loss_of, run_optionally_profiled, seeded, train


def amp_run(kind: str, settings: dict | None, steps: int = 6):
    model = seeded(DeepNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if kind == "fp16" else None
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    norms = []

    def train_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, model.batch(g))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(
                torch.linalg.vector_norm(
                    torch.cat([p.grad.flatten() for p in model.parameters()])
                ).item()
            )  # unscaled
            scaler.step(opt)
            scaler.update()
        return loss

    _, snap, _ = run_optionally_profiled(model, settings, steps, train_step)
    return model, snap, norms


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_mixed_precision_bit_identical_with_unscaled_norms(kind, every_step):
    reference, _, _ = amp_run(kind, None)
    model, snap, norms = amp_run(kind, every_step)
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert snap.step == 6 and snap.skipped_steps == 0
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in model.parameters()])
    ).item()
    assert snap.grad_norm == pytest.approx(expected, rel=1e-5)
    if kind == "fp16":
        # the scaler multiplies the loss by 4096: hookprof reads the gradients after unscale_
        assert snap.grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert all(s.forward_calls_total == 6 for s in snap.layers.values())


def test_accumulated_micro_batches_are_one_step(every_step):
    reference = seeded(DeepNet)
    train(reference, 3, micro_batches=4)
    model = seeded(DeepNet)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 3, micro_batches=4)
        prof.flush()
        snap = prof.snapshot()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert snap.step == 3 and snap.sampled_steps == 3
    for name, layer in snap.layers.items():
        assert layer.calls == 4, name  # the last step's four micro-batches, added up
        assert layer.forward_calls_total == 12, name
    assert snap.layers["stem"].backward_calls_total == 12


# ---- bad input -------------------------------------------------------------------------


def test_a_bare_module_with_no_parameters_and_no_leaves():
    with pytest.raises(ValueError, match="Module has no parameters"):
        hookprof.attach(nn.Module(), port=0)


def test_10000_leaves_attach_train_and_scrape():
    width = 10_000
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(width)])
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(2):
            loss = model(torch.randn(4, 2)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        prof.flush()
        f = parse(scrape(prof.url, timeout=60))
    assert samples(f, "hookprof_layers") == {frozenset({"rank": "0"}.items()): width}
    assert samples(f, "hookprof_layers_exported") == {frozenset({"rank": "0"}.items()): 500}
    exported = samples(f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count")
    assert len(exported) == 500 and set(exported.values()) == {2.0}
    assert samples(f, "hookprof_steps", "hookprof_steps_total") == {
        frozenset({"rank": "0"}.items()): 2
    }
