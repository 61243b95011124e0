"""Issue 28, as a user meets it through hookprof.attach() on the CPU and on the emulated
device 1 and 3 optimizer steps behind the host (support.lagging_device): every first NaN
ends in a named layer with how it was found, "(input)", transient, or not replayed with the
reason, and never "not yet localised" once flush() has returned.

The scenarios (support.first_nan) know where they put the NaN; each test compares hookprof's
answer with that. Under on_nonfinite "skip" and "raise" the loop's optimizer is a fused SGD,
whose non-finite update hookprof holds back on the device, so the step can be replayed late;
under "record" and "warn" nothing holds it back, and a device behind the host has applied it
before the step's flag arrives: that step is "not replayed" (replay.BEHIND says why)."""

from __future__ import annotations

import dataclasses
import logging
import socket

import pytest
import torch
from torch import nn

import hookprof
from hookprof.nonfinite.replay import BEHIND
from hookprof.view.summary import summary_text
from support.first_nan import (
    EVERY_STEP_CHECKED,
    LAGS,
    UNSAMPLED,
    Outcome,
    Overflow,
    SampledPoison,
    TransientPoison,
    WeightNaN,
    behind_by,
    event_key,
    run,
)
from support.metrics import parse, samples, scrape

HOST = socket.gethostname()
NOT_YET = "not yet localised"


def nan_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "NaN/Inf in the" in r.getMessage()]


def assert_never_not_yet_localised(result) -> None:
    """After flush(): neither the report's text nor the exit summary promises an answer that
    will not come; when no layer is named they say why (transient, or not replayed)."""
    report = result.prof.report()
    summary = summary_text(result.snapshot, result.prof.name)
    event = result.snapshot.first_nonfinite
    for text in (report, summary):
        assert NOT_YET not in text, text
        if event.layer is None and event.replay is not None:
            assert event.replay in text, text  # "transient" / "not replayed"
        elif event.layer is not None:
            assert f"first: {event.layer} " in text, text


def assert_event(event, expected: Outcome) -> None:
    assert event_key(event) == expected.key, event
    assert event.replay_note == expected.replay_note
    assert event.device == "cpu"


# ---------------------------------------------------------------- a. the CNN's NaN weight


def cnn_expected(lag: int, policy: str) -> Outcome:
    """features.3's weight is NaN from step 50 on (the loop wrote it, no update did): the
    replay of step 50 sees features.3 make a NaN from finite inputs with its own weights
    already non-finite, and no non-finite update before it. Behind the host only a held-back
    update (skip/raise, fused) leaves a step to replay."""
    if lag and policy in ("record", "warn"):
        return Outcome(None, "forward", 50, None, "not replayed", BEHIND)
    return Outcome("features.3", "forward", 50, "non-finite weights", "reproducible")


@pytest.mark.parametrize("policy", ["warn", "raise", "skip", "record"])
@pytest.mark.parametrize("lag", LAGS)
def test_a_cnn_whose_weight_is_made_nan_names_that_layer(lag, policy, caplog):
    scenario = WeightNaN(at=50)  # step 50 unsampled: only step 1 is, until the incident
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        result = run(scenario, lag=lag, policy=policy, steps=scenario.steps(lag))
    expected = cnn_expected(lag, policy)
    assert_event(result.snapshot.first_nonfinite, expected)
    lines = nan_lines(caplog)
    if policy == "raise":
        error = result.error
        assert error is not None
        assert (error.layer, error.phase, error.step, error.found_by, error.replay) == (
            "features.3",
            "forward",
            50,
            "non-finite weights",
            "reproducible",
        )
        assert "first in features.3: its weights are non-finite" in str(error)
        if lag == 0:
            assert result.error_step == 50
        else:  # the flag comes `lag` steps later, the held-back late replay names it then
            assert 50 < result.error_step <= 50 + 2 * lag + 2
    else:
        assert result.error is None
    if policy in ("warn", "skip"):
        assert len(lines) == 1, lines
        line = lines[0]
        assert line.startswith(
            "hookprof: NaN/Inf in the forward phase at step 50 on rank 0, first in "
        )
        if expected.layer is not None:
            assert "first in features.3: its weights are non-finite" in line
            assert "reproducible" in line
        else:
            assert "not replayed: " + BEHIND in line
    if policy == "record":
        assert lines == []
    assert_never_not_yet_localised(result)


# ---------------------------------------------------------------- b. dataclass outputs


@dataclasses.dataclass
class Prediction:
    value: torch.Tensor
    hidden: torch.Tensor


class DataclassNet(nn.Module):
    """encoder -> act -> decoder, returning a dataclass (as many libraries' models do)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.decoder = nn.Linear(16, 2)

    def forward(self, x):
        hidden = self.act(self.encoder(x))
        return Prediction(self.decoder(hidden), hidden)


BIAS_STEP = 6


@pytest.mark.parametrize("lag,policy", [(0, "record"), (0, "skip"), (1, "skip"), (3, "skip")])
def test_a_nan_bias_in_a_model_with_dataclass_outputs_names_its_layer(lag, policy):
    torch.manual_seed(0)
    model = DataclassNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    g = torch.Generator().manual_seed(1)
    with behind_by(lag):
        prof = hookprof.attach(model, **UNSAMPLED, on_nonfinite=policy, summary_at_exit=False)
        try:
            for step in range(1, BIAS_STEP + 2 * lag + 5):
                if step == BIAS_STEP:
                    with torch.no_grad():
                        model.decoder.bias[1] = float("nan")
                x = torch.randn(8, 8, generator=g)
                opt.zero_grad(set_to_none=True)
                out = model(x)
                nn.functional.mse_loss(out.value, x[:, :2]).backward()
                opt.step()
            prof.flush()
            event = prof.snapshot().first_nonfinite
            report = prof.report()
        finally:
            prof.detach()
    assert_event(
        event, Outcome("decoder", "forward", BIAS_STEP, "non-finite weights", "reproducible")
    )
    assert NOT_YET not in report


# ---------------------------------------------------------------- c. transformers' Trainer


NAN_WEIGHT_AT = 4  # the optimizer step (hookprof's step) whose forward first sees the NaN weight
C_FC = "transformer.h.1.mlp.c_fc"


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("lag", LAGS)
def test_transformers_trainer_with_a_nan_weight_names_h1_mlp_c_fc(lag, accumulation, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback

    from hookprof.integrations.huggingface import HookprofTrainerCallback

    policy = "record" if lag == 0 else "skip"  # skip: the fused AdamW's update is held back
    vocab, seq, batch, steps = 64, 8, 4, 8
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=32, n_layer=2, n_head=2)
    )
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, vocab, (steps * batch * accumulation, seq), generator=g)
    ]

    class NanWeight(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == NAN_WEIGHT_AT:
                with torch.no_grad():
                    model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")

    callback = HookprofTrainerCallback(**UNSAMPLED, on_nonfinite=policy, summary_at_exit=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        optim="adamw_torch_fused",
        max_grad_norm=1e9,
        logging_steps=steps,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[callback, NanWeight()]
    )
    with behind_by(lag):
        trainer.train()
    prof = callback.profiler
    assert prof.detached  # on_train_end
    snap = prof.snapshot()
    assert C_FC in snap.layers  # hookprof's name of the layer: its path in the model
    assert_event(
        snap.first_nonfinite,
        Outcome(C_FC, "forward", NAN_WEIGHT_AT, "non-finite weights", "reproducible"),
    )
    assert snap.first_nonfinite.layer.endswith("h.1.mlp.c_fc")
    assert NOT_YET not in summary_text(snap, prof.name)


# ---------------------------------------------------------------- d. seen on a sampled step


@pytest.mark.parametrize("lag", LAGS)
def test_a_stateful_poison_on_a_sampled_checked_step_is_named_every_time(lag):
    """The poison makes a NaN at its 7th call only; every step is sampled and checked, so
    step 7's own checks saw finite inputs and a NaN output. Twenty runs, each named from
    that step, whatever its replay then says (the poison's next call is finite: transient on
    the step's own weights, else no verdict)."""
    seen, expected = [], []
    for attempt in range(20):
        policy = ("record", "skip")[attempt % 2]
        scenario = SampledPoison(at=7)
        result = run(scenario, lag=lag, policy=policy, steps=scenario.steps(lag))
        seen.append(event_key(result.snapshot.first_nonfinite))
        expected.append(scenario.expected(lag, policy).key)
    assert seen == expected, seen
    assert all(key[:4] == ("poison", "forward", 7, "sampled step") for key in seen)


def test_a_stateful_poison_on_a_sampled_but_unchecked_step_is_transient():
    """Issue 28's own reproduction sampled every step but left activation_interval_s at its
    default, so step 7 was sampled without per-layer output checks (here: never checked after
    step 1, whatever the machine's speed). Nothing saw the poison make the NaN; its replay is
    finite: transient, no layer, never "not yet localised"."""
    scenario = TransientPoison(at=7)
    result = run(
        scenario,
        lag=0,
        policy="record",
        steps=scenario.steps(0),
        settings=dict(sample_every=1, min_sample_interval_s=0.0, activation_interval_s=3600.0),
    )
    assert result.snapshot.sampled_steps == scenario.steps(0)  # step 7 was a sampled step
    assert_event(result.snapshot.first_nonfinite, Outcome(None, "forward", 7, None, "transient"))
    assert_never_not_yet_localised(result)


# ---------------------------------------------------------------- e. transient


def transient_expected(lag: int, policy: str) -> Outcome:
    """Transient needs a replay on the step's own weights: lag 0 (or nonfinite_sync); a late
    replay under skip/raise ran after later updates, and under record/warn on a device behind
    there is none: not replayed, each with its reason."""
    return TransientPoison(at=7).expected(lag, "skip" if policy in ("skip", "raise") else "record")


@pytest.mark.parametrize("policy", ["record", "warn", "raise", "skip"])
@pytest.mark.parametrize("lag", LAGS)
def test_a_nan_that_its_replay_does_not_make_again_is_transient(lag, policy, caplog):
    """The same poison on an unsampled step: the replay of step 7 (the poison's 8th call)
    is finite. No layer can be proven; the NaN is transient, a hardware suspect: the words
    name the rank, the host and the device."""
    scenario = TransientPoison(at=7)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        result = run(scenario, lag=lag, policy=policy, steps=scenario.steps(lag))
    expected = transient_expected(lag, policy)
    assert_event(result.snapshot.first_nonfinite, expected)
    if expected.replay == "not replayed":
        assert "nonfinite_sync=True" in result.snapshot.first_nonfinite.replay_note
    said = [str(result.error)] if policy == "raise" else nan_lines(caplog)
    if policy == "record":
        assert said == []
    else:
        assert len(said) == 1, said
        assert said[0].startswith(
            "NaN/Inf in the forward phase at step 7 on rank 0"
            if policy == "raise"
            else "hookprof: NaN/Inf in the forward phase at step 7 on rank 0"
        )
        if expected.replay == "transient":
            assert "transient" in said[0]
            assert f"rank 0 on {HOST}, device cpu" in said[0]
        else:
            assert "not replayed: " + expected.replay_note in said[0]
    if policy == "raise":
        assert (
            result.error.layer,
            result.error.step,
            result.error.found_by,
            result.error.replay,
        ) == (None, 7, None, expected.replay)
    assert_never_not_yet_localised(result)


# ---------------------------------------------------------------- f. a row that overflows


@pytest.mark.parametrize("policy", ["record", "skip"])
@pytest.mark.parametrize("lag", LAGS)
def test_a_batch_row_that_overflows_fc1_is_reproducible_and_names_fc1(lag, policy):
    scenario = Overflow(at=5)
    result = run(scenario, lag=lag, policy=policy, steps=scenario.steps(lag))
    expected = scenario.expected(lag, policy)
    if lag == 0 or policy == "skip":
        assert expected == Outcome(
            "fc1", "forward", 5, "replay", "reproducible"
        )  # the scenario's own word
    assert_event(result.snapshot.first_nonfinite, expected)
    assert_never_not_yet_localised(result)


@pytest.mark.parametrize("lag", LAGS)
def test_a_batch_row_that_overflows_fc1_on_a_sampled_step_names_fc1_from_that_step(lag):
    """On a sampled, checked step its own checks saw fc1 overflow, and name it from there;
    the replay then makes it again (reproducible) when it can run on the step's weights."""
    scenario = Overflow(at=5)
    result = run(
        scenario, lag=lag, policy="record", steps=scenario.steps(lag), settings=EVERY_STEP_CHECKED
    )
    replay = ("reproducible", None) if lag == 0 else ("not replayed", BEHIND)
    assert_event(
        result.snapshot.first_nonfinite, Outcome("fc1", "forward", 5, "sampled step", *replay)
    )


# ---------------------------------------------------------------- the backward's first


def test_the_first_layer_of_a_backward_nan_stays_named_as_training_goes_on():
    """BackwardNaN: fc2's gradient goes NaN first at step 4 (every step sampled and timed),
    fc1's after it; fc2 is registered before fc1. Ten more steps must not change the answer."""
    from support.first_nan import BackwardNaN

    scenario = BackwardNaN(at=4)
    answers = {}
    for steps in (6, 14):
        result = run(scenario, lag=0, policy="record", steps=steps)
        answers[steps] = event_key(result.snapshot.first_nonfinite)
    assert answers == {
        6: scenario.expected(0, "record").key,
        14: scenario.expected(0, "record").key,
    }


# ---------------------------------------------------------------- g. the exported series


def test_a_transient_first_nan_is_exported_with_rank_host_and_device():
    scenario = TransientPoison(at=7)
    result = run(scenario, lag=0, policy="record", steps=scenario.steps(0), keep_attached=True)
    try:
        families = parse(scrape(result.prof.url))
    finally:
        result.prof.detach()
    origin = samples(families, "hookprof_first_nonfinite_origin_info")
    assert origin == {
        frozenset(
            {
                "rank": "0",
                "phase": "forward",
                "step": "7",
                "found_by": "",
                "replay": "transient",
                "host": HOST,
                "device": "cpu",
            }.items()
        ): 1.0
    }
