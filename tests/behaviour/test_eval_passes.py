"""Evaluation passes between training steps are ignored: under torch.no_grad(),
torch.inference_mode() or with the model in eval() mode (grad enabled). They count as
neither steps nor layer calls, a NaN in them is no incident, and training figures and
numerics are exactly those of a run without them."""

from __future__ import annotations

import torch

import hookprof
from support.models import DeepNet, seeded, train


def evaluate(model, how: str):
    x = torch.full((4, 8), float("nan"))  # an eval batch full of NaN: must not be an incident
    if how == "no_grad":
        with torch.no_grad():
            model(x)
    elif how == "inference_mode":
        with torch.inference_mode():
            model(x)
    else:  # eval mode with grad enabled, as in a validation loop that forgot no_grad
        model.eval()
        model(x).sum()
        model.train()


def run(settings, with_eval: bool):
    model = seeded(DeepNet)
    with hookprof.attach(model, **settings) as prof:
        def on_step(step, m):
            if with_eval:
                for how in ("no_grad", "inference_mode", "eval_mode"):
                    evaluate(m, how)
        train(model, 8, prof=prof, on_step=on_step, explicit_step=True)
        prof.flush()
        return model, prof.snapshot()


def test_eval_passes_change_nothing(every_step):
    plain_model, plain = run(every_step, with_eval=False)
    model, snap = run(every_step, with_eval=True)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert snap.step == plain.step == 8
    assert snap.sampled_steps == plain.sampled_steps
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
    assert snap.first_nonfinite is None
    for name, stats in plain.layers.items():
        got = snap.layers[name]
        assert got.forward_calls_total == stats.forward_calls_total, name
        assert got.backward_calls_total == stats.backward_calls_total, name
        assert got.nonfinite == stats.nonfinite, name
        assert got.grad_norm == stats.grad_norm, name
