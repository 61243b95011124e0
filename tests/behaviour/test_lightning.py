"""hookprof on a LightningModule under Trainer.fit (issue 18): the per-step view must be the
same as in a plain loop, whatever Lightning does around `optimizer.step`.

What Lightning 2.6 does in one automatic-optimization step (read in
lightning/pytorch/loops/optimization/automatic.py, _AutomaticOptimization._optimizer_step and
Closure.closure; lightning/pytorch/plugins/precision/precision.py, Precision.optimizer_step,
_wrap_closure and _after_closure):

    optimizer.step(closure)                 <- torch's optimizer-step pre-hooks run here
      closure():  training_step (forward), zero_grad, backward
                  on_before_optimizer_step  <- the independent norms are taken here
                  gradient clipping         (configure_gradient_clipping)
      the update reads .grad
                                            <- torch's optimizer-step post-hooks run here
    on_train_batch_end                      <- hookprof's view is read here

Every figure is compared step by step with one taken inside Lightning's own hooks."""

from __future__ import annotations

import pytest
import torch

lightning = pytest.importorskip(
    "lightning", reason="Lightning is a test extra (pip install -e '.[dev]'; .ci/run installs it)"
)

import hookprof  # noqa: E402
from support.inject import NanAt  # noqa: E402
from support.lightning_models import ReadEachStep, SetStep, fit, run_ddp_rank, seeded_regressor  # noqa: E402
from support.metrics import parse, samples  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # a DataLoader without workers is what a 2-core test wants; Lightning advises against it
    "ignore:.*does not have many workers:UserWarning",
    # Lightning 2.6 against torch 2.13's pytree; nothing for hookprof to act on
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated",
)

ISSUE_SETTINGS = dict(port=0, sample_every=1, min_sample_interval_s=0.0)  # the issue's attach line
STEPS = 12


def assert_norms_per_step(seen: dict, expected: list[dict[str, float]]) -> None:
    """hookprof's per-layer norms after step N (ReadEachStep.seen) equal expected[N - 1], for
    every step N, and hookprof's own step numbers say that what it shows is step N."""
    steps = len(expected)
    assert sorted(seen) == list(range(1, steps + 1))
    for step, (counted, sampled, norms) in seen.items():
        assert (counted, sampled) == (step, step), f"step {step}"
        assert norms == pytest.approx(expected[step - 1], rel=1e-5), f"step {step}"


def profiled_fit(
    module, steps: int, tmp_path, settings=ISSUE_SETTINGS, callbacks=(), **trainer_kwargs
):
    """Trainer.fit with hookprof attached to the LightningModule; returns (snapshot after
    detach, the per-step reader)."""
    with hookprof.attach(module, **settings) as prof:
        reader = ReadEachStep(prof)
        fit(module, steps, callbacks=[reader, *callbacks], root_dir=tmp_path, **trainer_kwargs)
    return prof.snapshot(), reader


# issue 18 (1): hookprof read .grad at the optimizer's pre-hook, before Lightning's closure
# had run step N's zero_grad and backward: no norms at step 1, step N-1's at step N
def test_automatic_optimization_norms_are_those_of_each_step(tmp_path):
    reference = seeded_regressor()
    fit(reference, STEPS, root_dir=tmp_path)

    model = seeded_regressor()
    snap, reader = profiled_fit(model, STEPS, tmp_path)

    # training unchanged (this much holds today)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert snap.step == STEPS and len(model.before_step) == STEPS
    assert set(model.before_step[0]) == {"body.0", "body.2", "body.5"}
    assert_norms_per_step(reader.seen, model.before_step)


# issue 18 (2), before entry calls: first_nonfinite == ("body.5", "backward", 7) and no step
# counted as forward: the root's forward never runs under Lightning (training_step calls
# self.body), so there was no output check and no producer. Now `body`, called from
# outside the model, is the step's forward: checked, kept for a replay
@pytest.mark.parametrize(
    "settings",
    [ISSUE_SETTINGS, dict(ISSUE_SETTINGS, activation_interval_s=0.0)],
    ids=["issue-settings", "every-step-checked"],
)
def test_forward_nan_in_a_middle_layer_is_named_with_its_step(settings, tmp_path):
    nan = NanAt({7})
    model = seeded_regressor(middle=nan)
    snap, _ = profiled_fit(model, 10, tmp_path, settings, callbacks=[SetStep(nan)])
    event = snap.first_nonfinite
    assert event is not None
    assert (event.layer, event.phase, event.step) == ("body.3", "forward", 7)
    assert snap.nonfinite_steps["forward"] >= 1


def test_manual_optimization_norms_are_those_of_each_step(tmp_path):
    """backward in training_step, then opt.step() without a closure of the user's: Lightning
    still passes one (Precision._wrap_closure, which only calls on_before_optimizer_step), but
    the gradients are final before optimizer.step begins."""
    model = seeded_regressor(manual=True)
    snap, reader = profiled_fit(model, STEPS, tmp_path)
    assert snap.step == STEPS
    assert_norms_per_step(reader.seen, model.before_step)


def clipped(model, step: int) -> dict[str, float]:
    """The norms after gradient_clip_val=1.0 (torch.nn.utils.clip_grad_norm_ over all the
    optimizer's parameters: every gradient times min(1, 1 / (total norm + 1e-6)))."""
    coef = min(1.0, 1.0 / (model.total_before_step[step - 1] + 1e-6))
    return {name: norm * coef for name, norm in model.before_step[step - 1].items()}


# Which gradients hookprof must report is "the ones the update reads". Lightning calls
# on_before_optimizer_step before clipping (Precision._after_closure: the hook, then
# _clip_gradients), so under gradient_clip_val the expected norms are the clipped ones,
# computed here from the hook's unclipped norms; ReadEachStep.after_step (the .grad left
# after the update) confirms that this is what the optimizer read.
# issue 18 (1): accumulation showed the first micro-batch's gradients alone, clipping and
# bf16 step N-1's gradients at step N and none at step 1 (all read before the closure)
@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        dict(accumulate_grad_batches=2),
        dict(gradient_clip_val=1.0),
        dict(precision="bf16-mixed"),
    ],
    ids=["accumulate-2", "clip-1.0", "bf16-mixed"],
)
def test_norms_under_trainer_settings_are_those_the_update_reads(trainer_kwargs, tmp_path):
    steps = 6
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    model = seeded_regressor()
    snap, reader = profiled_fit(
        model, steps, tmp_path, batches=steps * accumulate, **trainer_kwargs
    )
    assert snap.step == steps and len(model.before_step) == steps
    if "gradient_clip_val" in trainer_kwargs:
        expected = [clipped(model, step) for step in range(1, steps + 1)]
        assert all(total > 1.0 for total in model.total_before_step)  # clipping did clip
    else:
        expected = model.before_step
    for step, norms in reader.after_step.items():  # the expectation is what the update read
        assert norms == pytest.approx(expected[step - 1], rel=1e-5), f"step {step}"
    assert_norms_per_step(reader.seen, expected)


# issue 18 (1): step 1 showed no norms on either rank (read at the pre-hook, before the
# closure); under DDP the root's forward does run (Lightning's _ForwardRedirection calls
# training_step through DDP.forward -> LightningModule.__call__)
@pytest.mark.slow
def test_ddp_two_ranks_report_the_all_reduced_norms_of_each_step():
    """Trainer(strategy="ddp", devices=2) over gloo, each rank launched as torchrun would:
    the norms after DDP's all-reduce, the same on both ranks, step by step."""
    from support.ranks import run_two

    steps = 4
    results, texts, _ = run_two(run_ddp_rank, steps)
    # each rank its own data, the same gradients once all-reduced
    assert results[0][1] == results[1][1]
    for rank, (_, before_step, seen) in results.items():
        assert samples(parse(texts[rank]), "hookprof_steps", "hookprof_steps_total") == {
            frozenset({"rank": str(rank)}.items()): steps
        }
        assert_norms_per_step(seen, before_step)


class ScaleAfterEachStep(lightning.Callback):
    """The GradScaler's scale after each step's update(): a skip halves it."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(self.scaler.get_scale())  # the test's own sync, not hookprof's


@pytest.mark.cuda
def test_16_mixed_with_its_scaler_on_a_gpu_counts_the_scalers_skips(tmp_path):
    """precision="16-mixed" on CUDA: Lightning runs the closure, unscales and calls
    on_before_optimizer_step outside optimizer.step, then scaler.step(): hookprof's skipped
    steps are the scaler's own, and an updating step's norms are the unscaled gradients."""
    from lightning.pytorch.plugins import MixedPrecision

    steps = 12
    # GradScaler's default: this model's fp16 gradients overflow at it (the targets are large),
    # so some steps are skipped and others update. From 2**24 every one of the 12 steps
    # overflowed (fp16 autocast on the CPU), which left nothing to compare and made 12 skips
    # in a row, an incident beyond max_skipped_steps; from 2**16, 7 of 12 skipped, 2 in a row
    init_scale = 2.0**16
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
    scales = ScaleAfterEachStep(scaler)
    model = seeded_regressor()
    snap, reader = profiled_fit(
        model,
        steps,
        tmp_path,
        callbacks=[scales],
        accelerator="cuda",
        plugins=[MixedPrecision("16-mixed", "cuda", scaler)],
    )
    skipped = [after < before for before, after in zip([init_scale, *scales.scales], scales.scales)]
    assert snap.step == steps and 0 < sum(skipped) < steps
    assert snap.skipped_steps == sum(skipped)
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}  # a skip is no incident
    for step, (_, _, norms) in reader.seen.items():
        if not skipped[step - 1]:
            assert norms == pytest.approx(model.before_step[step - 1], rel=1e-5), f"step {step}"
