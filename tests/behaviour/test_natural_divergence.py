"""The first NaN/Inf of divergences nobody injected (issue 38, item 1): each run diverges on
its own (a learning rate too high, an fp16 overflow, a batch with a constant feature), and
hookprof's first event (phase, layer, step) must be what hooks of the test's own saw
(support/own_hooks.py): the first layer output in forward order that went non-finite, else
the loss, else the first gradient in the order backward computed it.

The GPT-2 run is the issue's: transformers' Trainer clips with max_norm=inf every step to
log the norm, which multiplies every gradient by the NaN norm before the optimizer reads
them; hookprof checks the gradients at the backward's end (step/backward_end.py), before
that."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.nonfinite import reproduce
from support.first_nan import UNSAMPLED, behind_by
from support.own_hooks import OwnHooks


def first_event(prof) -> tuple[str, str | None, int] | None:
    event = prof.snapshot().first_nonfinite
    if event is None:
        return None
    layer = None if event.phase == "loss" else event.layer
    return (event.phase, layer, event.step)


def train(
    model: nn.Module,
    batches,
    *,
    lr: float,
    steps: int,
    lag: int = 0,
    scale: float = 1.0,
    loss_fn=nn.functional.mse_loss,
) -> tuple[tuple | None, tuple | None]:
    """SGD on `model` for `steps` batches with hookprof attached (defaults: unsampled steps)
    and the test's own hooks; the loss handed to prof.step(). On the emulated device `lag`
    steps behind the host, a fused SGD under on_nonfinite="skip": a forward NaN's flag comes
    after the update, which skip holds back on the device so that the late replay still has
    the step's weights (under "record" hookprof says it could not replay, and why:
    test_first_nonfinite.py). Returns (hookprof's first event, the own hooks' first)."""
    own = OwnHooks()
    with behind_by(lag):
        prof = hookprof.attach(
            model,
            config=hookprof.Config(
                summary_at_exit=False, on_nonfinite="skip" if lag else "record", **UNSAMPLED
            ),
        )
        try:
            own.replaying = lambda: _testing.replaying(prof)
            own.watch(model)
            opt = torch.optim.SGD(model.parameters(), lr=lr, fused=bool(lag))
            for _, (x, y) in zip(range(steps), batches):
                opt.zero_grad()
                loss = loss_fn(model(x).float(), y)
                own.loss(loss)
                (
                    loss * scale
                ).backward()  # scale: a static loss scale, as fp16 code had before GradScaler
                opt.step()
                prof.step(loss)
                own.stepped()
            prof.flush()
            return first_event(prof), own.first()
        finally:
            own.remove()
            prof.detach()


def gaussian(shape_x, shape_y, *, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(*shape_x, generator=g).to(dtype), torch.randn(*shape_y, generator=g)


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    ).to(dtype)


@pytest.mark.parametrize("lag", [0, 3])
def test_an_fp16_backward_overflow_names_the_first_gradient_computed(lag):
    """A float16 MLP with a static loss scale of 1024: at step 2 its output is finite and its
    gradients overflow, first in the last Linear (the first backward computes)."""
    seen, own = train(
        mlp(torch.float16),
        gaussian((32, 16), (32, 1), dtype=torch.float16),
        lr=0.1,
        steps=6,
        lag=lag,
        scale=1024.0,
    )
    assert own is not None and own[0] == "backward", own  # the run diverged, in its backward
    assert seen == own


@pytest.mark.parametrize("lr, layer", [(0.05, "4"), (0.5, "2")])
def test_an_fp16_forward_overflow_names_its_layer(lr, layer):
    """The same model, a larger loss scale: the update of step 1 makes step 2's forward
    overflow float16, in the last Linear or, with a larger step, the middle one. (The
    output's check sums in float32: a sum past 65504 is no overflow of the output.) A device
    behind the host is tested with a forward NaN below (a fused SGD, as skip needs, takes
    this run to a backward overflow instead)."""
    seen, own = train(
        mlp(torch.float16),
        gaussian((32, 16), (32, 1), dtype=torch.float16),
        lr=lr,
        steps=6,
        scale=4096.0,
    )
    assert own == ("forward", layer, 2)
    assert own is not None and own[0] == "forward", own
    assert seen == own


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(8, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.head(h[:, -1])


@pytest.mark.parametrize("lr", [1.0, 10.0])
def test_an_exploding_lstm_is_named_where_it_first_overflows(lr):
    """An LSTM regressing targets of scale 100 with SGD at a learning rate that explodes:
    its gradient norms pass 1.8e19 well before anything is non-finite (a float32 dot of such
    a gradient with itself overflows: hookprof's CPU norms take those again in float64),
    and the first non-finite value is the loss, whose squares overflow."""

    def targets():
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(16, 50, 8, generator=g), 100 * torch.randn(16, 1, generator=g)

    seen, own = train(Recurrent(), targets(), lr=lr, steps=60)
    assert own is not None, "the LSTM did not diverge"
    assert seen == own


def test_finite_gradients_past_1e19_are_not_called_non_finite():
    """The cliff of the CPU norm path on its own: a gradient of norm ~1e20, all finite."""
    model = nn.Linear(4, 4)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **UNSAMPLED))
    try:
        for _ in range(3):
            model.zero_grad()
            (model(torch.ones(2, 4)).sum() * 1e20).backward()
            assert torch.isfinite(model.weight.grad).all() and model.weight.grad.norm() > 1e19
            prof.step()
        prof.flush()
        assert prof.snapshot().first_nonfinite is None
    finally:
        prof.detach()


class Standardize(nn.Module):
    """A hand-written normalisation without an epsilon, (x - mean) / std per feature, as
    normalising code often is: a feature constant over the batch makes 0 / 0."""

    def __init__(self, n: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x - x.mean(0)) / x.std(0) * self.gain


def constant_feature_at(step: int, n: int = 8):
    """Batches of 16 rows; at `step` feature 3 is the same in every row (a padded column)."""
    g = torch.Generator().manual_seed(1)
    k = 0
    while True:
        k += 1
        x = torch.randn(16, n, generator=g)
        if k == step:
            x[:, 3] = 0.5
        yield x, torch.randn(16, 1, generator=g)


@pytest.mark.parametrize("lag", [0, 3])
def test_a_zero_variance_batch(lag):
    """PyTorch's BatchNorm has an epsilon (and refuses 0 in training): a zero-variance
    batch stays finite, and nothing is reported. A hand-written standardisation divides 0
    by 0 on the same batch: its layer is named, at that step, in the forward."""
    torch.manual_seed(0)
    batchnorm = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    seen, own = train(batchnorm, constant_feature_at(4), lr=0.1, steps=6, lag=lag)
    assert own is None and seen is None
    torch.manual_seed(0)
    by_hand = nn.Sequential(Standardize(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    seen, own = train(by_hand, constant_feature_at(4), lr=0.1, steps=6, lag=lag)
    assert own == ("forward", "0", 4)
    assert seen == own


@pytest.mark.parametrize("lag", [0, 3])
def test_gpt2_under_the_trainer_names_the_first_gradient_backward_computed(lag, tmp_path):
    """The issue's run: a tiny GPT-2 on random tokens, transformers' Trainer, SGD at lr 10,
    diverging in its backward at step 9, first in block 0's MLP, while ln_f's gradient is
    still finite (it goes non-finite at step 10, after the clip's NaN reached the weights).
    hookprof used to name ln_f: the Trainer's clip_grad_norm_(inf) multiplied every
    gradient by the NaN norm before the optimizer's pre-hook read them. Its capsule was
    named step 10 and could not be replayed; it now holds step 9 and replays to the layer."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback

    from hookprof.integrations.huggingface import HookprofTrainerCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    )
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4096, 32), generator=g)
    ]
    own = OwnHooks().watch(model)

    class Own(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            own.stepped()

    _testing.forget_capsules_written()
    callback = HookprofTrainerCallback(
        **UNSAMPLED, summary_at_exit=False, capsule_dir=str(tmp_path / "capsules")
    )
    own.replaying = lambda: callback.profiler is not None and _testing.replaying(callback.profiler)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=12,
        learning_rate=10,
        optim="sgd",
        max_grad_norm=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        lr_scheduler_type="constant",
        warmup_steps=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[Own(), callback]
    )
    with behind_by(lag):
        trainer.train()
    own.remove()
    expected = own.first()
    assert expected is not None and expected[0] == "backward", expected
    assert expected[1].startswith("transformer.h.0."), expected  # not ln_f
    assert "transformer.ln_f" not in own.grads[expected[2]]  # still finite that step
    assert first_event(callback.profiler) == expected
    # its capsule (issue 38, item 2): of step 9 itself, replayed to the same first layer;
    # behind the host (no nonfinite_sync) none, and the log said why (test_backward_capsule.py)
    capsule = callback.profiler.snapshot().first_nonfinite.capsule
    if lag:
        assert capsule is None
        return
    assert f"-step{expected[2]}-" in capsule
    lines = []
    assert reproduce.replay(capsule, say=lines.append) == reproduce.REPRODUCED
    assert lines[0].endswith(f"(layer {expected[1]})"), lines[0]


def test_a_finite_fp16_output_whose_sum_passes_65504_is_no_nan():
    """The output check used to sum a float16 output in float16: 256 finite values of ~300
    add up past 65504, and a healthy fp16 model read as a forward NaN at every step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 256).half()
    with torch.no_grad():
        model.weight.fill_(75.0)
        model.bias.zero_()
    x = torch.ones(1, 4, dtype=torch.float16)
    assert torch.isfinite(model(x)).all() and not torch.isfinite(
        model(x).sum()
    )  # fp16's own sum overflows
    with hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **UNSAMPLED)) as prof:
        for _ in range(3):
            model.zero_grad()
            model(x).float().mean().backward()
            prof.step()
        prof.flush()
        assert prof.snapshot().first_nonfinite is None
        assert prof.snapshot().nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
