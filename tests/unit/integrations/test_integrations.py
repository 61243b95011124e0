"""The trainer integrations (issue 18): a Lightning callback and a Hugging Face
TrainerCallback that own attach and detach and log hookprof's headline scalars through the
trainer's loggers. Each runs the real trainer; the figures the loggers receive are compared
with hookprof's snapshot and with figures the trainer computes itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hookprof.integrations.scalars import (
    GRAD_NORM,
    PREFIX,
    SAMPLED_STEP,
    counters,
    headline,
    step_count,
)
from support.hooks_left import model_state
from support.settings import EVERY_STEP

STEPS = 6


def importorskip(name: str, extra: str):
    return pytest.importorskip(
        name, reason=f"{extra} is a test extra (pip install -e '.[dev]'; .ci/run installs it)"
    )


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_importing_hookprof_imports_no_trainer():
    out = run_python("""
        import sys
        import hookprof, hookprof.integrations, hookprof.integrations.scalars
        print(sorted({"lightning", "pytorch_lightning", "transformers"} & set(sys.modules)))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module, package", [("lightning", "lightning"), ("huggingface", "transformers")]
)
def test_integration_without_its_package_names_what_to_install(module, package):
    # None in sys.modules makes `import <package>` raise ImportError, as if it were absent
    out = run_python(f"""
        import sys
        sys.modules["{package}"] = None
        import hookprof.integrations.{module}
    """)
    assert out.returncode != 0
    assert f"ImportError: hookprof.integrations.{module} needs" in out.stderr
    assert f"pip install {package}" in out.stderr


def assert_rows_are_the_snapshots(rows: list[tuple[int, dict, object]], final) -> None:
    """Each logged row (step, scalars, the snapshot they came from) holds that snapshot's
    headline scalars at the step its counters describe, with the step time as the mean
    since the previous row and a sampled step's gradient norm once, naming its step; the
    last row has the final counts (issue 32: they were logged at an older sampled step, and
    the final ones never)."""
    steps = [step for step, _, _ in rows]
    assert steps == sorted(set(steps)), "a step logged twice"
    previous, total = None, 0.0
    for step, scalars, snap in rows:
        assert step == snap.step
        assert scalars == headline(snap, previous)
        assert scalars[PREFIX + "nonfinite_steps/backward"] == snap.nonfinite_steps["backward"]
        if GRAD_NORM in scalars:
            assert (
                scalars[SAMPLED_STEP]
                == snap.last_sampled_step
                != (previous and previous.last_sampled_step)
            )
        # the windows' mean step times, times their step counts, add up to the duration sum
        total += scalars[PREFIX + "step_time_s"] * (
            step_count(snap) - (step_count(previous) if previous else 0)
        )
        previous = snap
    assert steps[-1] == final.step == step_count(final)
    assert counters(final) == {k: v for k, v in rows[-1][1].items() if k in counters(final)}
    assert total == pytest.approx(final.step_duration_sum, rel=1e-9)


# ---------------------------------------------------------------- Lightning


@pytest.fixture
def lightning_parts():
    importorskip("lightning", "Lightning")
    from hookprof.integrations import lightning as integration
    from support import lightning_models

    return lightning_models, integration


def recording_logger(callback):
    """A Lightning Logger that keeps (step, metrics, the snapshot the callback logged them
    from) for every log_metrics call."""
    from lightning.pytorch.loggers import Logger

    class Recorder(Logger):
        name = "recorder"
        version = 0

        def __init__(self):
            super().__init__()
            self.rows = []

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics), callback.last_logged))

    return Recorder()


def watcher(callback, seen: list):
    """A Lightning callback noting, at each batch, whether hookprof is attached to the
    LightningModule itself."""
    import lightning as L

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            prof = callback.profiler
            seen.append(prof is not None and not prof.detached and prof.model is pl_module)

    return Watch()


lightning_warnings = pytest.mark.filterwarnings(  # as in test_lightning, and a fit of few batches
    "ignore:.*does not have many workers:UserWarning",
    "ignore:The number of training batches .* is smaller than the logging interval",
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated",
)


@lightning_warnings
def test_lightning_callback_attaches_for_fit_and_logs_the_snapshot(lightning_parts, tmp_path):
    models, integration = lightning_parts
    reference = models.seeded_regressor()
    models.fit(reference, STEPS, root_dir=tmp_path)

    model = models.seeded_regressor()
    callback = integration.HookprofCallback(**EVERY_STEP)
    logger = recording_logger(callback)
    seen: list[bool] = []
    started = time.perf_counter()
    trainer = models.fit(
        model,
        STEPS,
        callbacks=[callback, watcher(callback, seen)],
        root_dir=tmp_path,
        logger=logger,
    )
    wall = time.perf_counter() - started

    # attached to the LightningModule for every batch, gone after fit (the module holds what
    # a fit without hookprof leaves on it), training unchanged
    assert seen == [True] * STEPS
    assert callback.profiler.detached and model_state(model) == model_state(reference)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    final = callback.profiler.snapshot()
    assert final.step == trainer.global_step == STEPS
    assert_rows_are_the_snapshots(logger.rows, final)
    assert 0 < final.step_duration_sum < wall
    # the norms are those Lightning handed to each update (on_before_optimizer_step; no
    # clipping here), each at the step it names
    normed = [row for _, row, _ in logger.rows if GRAD_NORM in row]
    assert normed
    for scalars in normed:
        step = int(scalars[SAMPLED_STEP])
        assert scalars[GRAD_NORM] == pytest.approx(model.total_before_step[step - 1], rel=1e-5)
    assert logger.rows[-1][1][PREFIX + "nonfinite_steps/backward"] == 0
    # the loss reached hookprof (issue 32: never): the last step's, as training_step made it
    assert final.loss == pytest.approx(model.losses[-1], rel=1e-6)


@lightning_warnings
def test_lightning_callback_logs_a_nan_and_detaches_when_fit_fails(lightning_parts, tmp_path):
    models, integration = lightning_parts

    class FailAt(models.SetStep):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if trainer.global_step == 5:
                raise RuntimeError("the data went away")

    def failing_fit(callbacks, **kwargs):
        nan = models.NanAt({3})
        model = models.seeded_regressor(middle=nan)
        with pytest.raises(RuntimeError, match="the data went away"):
            models.fit(model, 8, callbacks=[*callbacks, FailAt(nan)], root_dir=tmp_path, **kwargs)
        return model

    reference = failing_fit([])
    callback = integration.HookprofCallback(**EVERY_STEP)
    logger = recording_logger(callback)
    model = failing_fit([callback], logger=logger)

    assert callback.profiler.detached and model_state(model) == model_state(
        reference
    )  # on_exception
    final = callback.profiler.snapshot()
    assert final.step == 5
    assert_rows_are_the_snapshots(logger.rows, final)  # the last one logged at on_exception
    # the NaN made at step 3 spreads into every gradient from step 3 on
    for step, scalars, _ in logger.rows:
        assert (scalars[PREFIX + "nonfinite_steps/backward"] > 0) == (step >= 3), step
    assert final.nonfinite_steps["backward"] == 3
    # issue 32: the NaN loss of steps 3, 4 and 5 was counted as none ("loss 0")
    assert final.nonfinite_steps["loss"] == 3
    assert logger.rows[-1][1][PREFIX + "nonfinite_steps/loss"] == 3


@lightning_warnings
@pytest.mark.parametrize("accumulate", [1, 3])
def test_lightning_callback_hands_each_optimizer_steps_loss_to_hookprof(
    lightning_parts, tmp_path, accumulate
):
    """prof.step(loss) once per optimizer step, with the mean of its micro-batches' losses
    (Lightning divides each by accumulate_grad_batches; the callback adds them up)."""
    models, integration = lightning_parts
    steps = 4
    callback = integration.HookprofCallback(**EVERY_STEP)
    losses: dict[int, float] = {}

    import lightning as L

    class ReadLoss(L.Callback):  # runs after the hookprof callback: the step is handed over
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate == 0:
                callback.profiler.flush()
                snap = callback.profiler.snapshot()
                losses[snap.step] = snap.loss

    model = models.seeded_regressor()
    trainer = models.fit(
        model,
        steps,
        callbacks=[callback, ReadLoss()],
        root_dir=tmp_path,
        batches=steps * accumulate,
        accumulate_grad_batches=accumulate,
    )
    assert trainer.global_step == callback.profiler.snapshot().step == steps
    expected = {
        step: sum(model.losses[(step - 1) * accumulate : step * accumulate]) / accumulate
        for step in range(1, steps + 1)
    }
    assert losses == pytest.approx(expected, rel=1e-6)
    page = callback.profiler.snapshot()
    assert page.nonfinite_steps["loss"] == 0


# ---------------------------------------------------------------- Hugging Face

VOCAB, SEQ, BATCH = 97, 16, 4
HF_STEPS = 4


def hf_train(tmp_path, callbacks, mixin: bool = False):
    """transformers.Trainer on a 2-layer GPT-2 from a config (nothing downloaded), HF_STEPS
    steps, a log every step, no clipping (max_grad_norm huge: Trainer still computes and logs
    the norm, and multiplies the gradients by exactly 1)."""
    transformers = importorskip("transformers", "transformers")
    importorskip("accelerate", "accelerate (transformers.Trainer needs it)")
    from hookprof.integrations.huggingface import HookprofTrainerMixin

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2
    )
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, VOCAB, (HF_STEPS * BATCH, SEQ), generator=g)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=HF_STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_grad_norm=1e9,
        dataloader_num_workers=0,
    )
    trainer_class = transformers.Trainer
    if mixin:
        trainer_class = type("ProfiledTrainer", (HookprofTrainerMixin, transformers.Trainer), {})
    trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=callbacks)
    return model, trainer


def early_recorder(seen: list):
    """A callback that runs before any given to the Trainer, as the report_to integrations
    do, and keeps the logs it is handed."""
    from transformers import TrainerCallback

    class Early(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    return Early()


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The model trained without hookprof (once for the module: Trainer takes seconds)."""
    reference, trainer = hf_train(tmp_path_factory.mktemp("reference"), [])
    trainer.train()
    return reference


@pytest.mark.parametrize("mixin", [False, True], ids=["callback", "callback+mixin"])
def test_hf_callback_attaches_for_train_and_logs_the_snapshot(mixin, hf_reference, tmp_path):
    from transformers import TrainerCallback

    from hookprof.integrations.huggingface import HookprofTrainerCallback

    callback = HookprofTrainerCallback(**EVERY_STEP)
    seen: list[bool] = []
    early: list[dict] = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            prof = callback.profiler
            seen.append(prof is not None and not prof.detached and prof.model is model)

    model, trainer = hf_train(tmp_path, [callback, Watch()], mixin=mixin)
    trainer.callback_handler.callbacks.insert(0, early_recorder(early))
    trainer.train()

    # attached to the model for every step, gone after training (the model holds what training
    # without hookprof leaves on it), training unchanged
    assert seen == [True] * HF_STEPS
    assert callback.profiler.detached and model_state(model) == model_state(hf_reference)
    for (name, a), b in zip(hf_reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    final = callback.profiler.snapshot()
    assert final.step == trainer.state.global_step == HF_STEPS
    # one log per step: each carries the scalars of its own step (flushed at the log)
    rows = [entry for entry in trainer.state.log_history if PREFIX + "sampled_step" in entry]
    assert (
        [row["step"] for row in rows]
        == [row[SAMPLED_STEP] for row in rows]
        == list(range(1, HF_STEPS + 1))
    )
    assert {k: v for k, v in rows[-1].items() if k in counters(final)} == counters(final)
    # unclipped here (max_grad_norm huge), the norm hookprof read after clipping is the one
    # Trainer computed before it for the same step (clip_grad_norm_)
    for row in rows:
        assert row[GRAD_NORM] == pytest.approx(row["grad_norm"], rel=1e-5)
    # the loss: with the mixin each step's, as Trainer logs it (a log every step: the step's)
    if mixin:
        assert final.loss == pytest.approx(rows[-1]["loss"], rel=1e-5)
    else:
        assert final.loss is None
    means = [row[PREFIX + "step_time_s"] for row in rows]
    assert sum(means) == pytest.approx(final.step_duration_sum, rel=1e-9)

    # the report_to integrations run first: only the mixin's Trainer.log reaches them
    reached = [entry for entry in early if GRAD_NORM in entry]
    assert len(reached) == (HF_STEPS if mixin else 0)
