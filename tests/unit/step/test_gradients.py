"""Gradient norms against torch.linalg.vector_norm computed independently."""

from __future__ import annotations

import math

import pytest
import torch

import hookprof
from support.models import DeepNet, MixedNet, seeded, train

# hookprof takes each parameter's norm in float32 and sums squares in float64; the reference
# concatenates a layer's gradients and takes one float32 norm. They agree to float32 rounding.
RTOL = 1e-5


def reference_layer_norms(model: torch.nn.Module) -> dict[str, float]:
    """Each module's own (direct) parameters' gradients; a parameter counts for the first
    module that owns it, as in named_parameters()."""
    out, seen = {}, set()
    for name, module in model.named_modules():
        grads = []
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                if p.grad is not None:
                    grads.append(p.grad.flatten())
        if grads:
            out[name or "(root)"] = torch.linalg.vector_norm(torch.cat(grads)).item()
    return out


@pytest.mark.parametrize("explicit_step", [False, True], ids=["optimizer-hooks", "prof.step"])
@pytest.mark.parametrize("model_cls", [MixedNet, DeepNet])
def test_layer_norms_equal_vector_norm(model_cls, explicit_step, every_step):
    model = seeded(model_cls)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 4, prof=prof, explicit_step=explicit_step)
        prof.flush()
        snap = prof.snapshot()
    expected = reference_layer_norms(model)
    got = {name: s.grad_norm for name, s in snap.layers.items() if s.grad_norm is not None}
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=RTOL), name
    all_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert snap.grad_norm == pytest.approx(torch.linalg.vector_norm(all_grads).item(), rel=RTOL)
    assert snap.sampled_steps == 4 and snap.step == 4


def test_every_parameter_is_covered():
    model = seeded(MixedNet)
    with hookprof.attach(model, port=0) as prof:
        table = prof.table
        assert sorted(table.param_names) == sorted(n for n, _ in model.named_parameters())
        owners = {
            table.param_names[i]: table.layers[table.param_layer[i]].name
            for i in range(len(table.params))
        }
    # MultiheadAttention owns in_proj_weight; out_proj is a layer though never called
    assert owners["attn.in_proj_weight"] == "attn"
    assert owners["attn.out_proj.weight"] == "attn.out_proj"


def test_norms_read_after_gradient_accumulation(every_step):
    """With 3 micro-batches per optimizer step, the norm is that of the summed gradient."""
    model = seeded(DeepNet)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 2, micro_batches=3)
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 2
    for name, value in reference_layer_norms(model).items():
        assert snap.layers[name].grad_norm == pytest.approx(value, rel=RTOL)


def test_frozen_layers_have_no_norm(every_step):
    model = seeded(DeepNet)
    model.stem.requires_grad_(False)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 2)
        prof.flush()
        snap = prof.snapshot()
    assert snap.layers["stem"].grad_norm is None
    assert math.isfinite(snap.layers["head"].grad_norm)


def test_sparse_embedding_gradient_norm(every_step):
    """nn.Embedding(sparse=True) gives a sparse gradient; its norm is that of the dense one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(24, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.tensor([[1, 2, 2], [7, 1, 49]])  # repeated rows: the gradient needs coalescing
    with hookprof.attach(model, **every_step) as prof:
        opt.zero_grad()
        model(tokens).square().mean().backward()
        assert model[0].weight.grad.is_sparse
        expected = torch.linalg.vector_norm(model[0].weight.grad.to_dense()).item()
        opt.step()
        prof.flush()
        got = prof.snapshot().layers["0"].grad_norm
    assert math.isclose(got, expected, rel_tol=RTOL)
