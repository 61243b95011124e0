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


def test_training_in_eval_mode_is_training(every_step, caplog):
    """Issue 29 item 7: fine-tuning with frozen BatchNorm (model.eval() while gradients flow
    and the optimizer steps) is training: the layers' forward calls are recorded on sampled
    steps and a NaN made by layer '3' at step 6 is named there, in the forward (before: 0
    forward calls over 8 sampled steps, and ('4', backward, 6)). A pass under no_grad stays
    an evaluation."""
    from support.inject import StepInjector

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 1),
    )
    injector = StepInjector(model[3], {6})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(model, **every_step, on_nonfinite="record") as prof:
        model.eval()  # BatchNorm frozen: running statistics used, not updated
        for step in range(1, 9):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            x = torch.randn(16, 8, generator=g)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            with torch.no_grad():  # a validation pass: still no step, no layer call
                model(torch.full((4, 8), float("nan")))
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 8
    assert snap.sampled_steps == 8
    # step 1's forward came before hookprof could know (said in a notice): steps 2 to 8
    for name in ("0", "1", "2", "3", "4"):
        assert snap.layers[name].forward_calls_total == 7, name
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("3", "forward", 6)
    assert snap.nonfinite_steps["forward"] == 3  # 6, then 7 and 8 on the weights step 6 hit
    assert any("trains in eval mode" in r.getMessage() for r in caplog.records)
