"""A Lightning callback that attaches hookprof for each `Trainer.fit` and logs its headline
scalars through the trainer's loggers.

    from hookprof.integrations.lightning import HookprofCallback
    trainer = L.Trainer(callbacks=[HookprofCallback(sample_every=50)])

Not needed for correct data: `hookprof.attach(lightning_module)` before `fit` measures the
same; the callback only lets the trainer own attach and detach, and logs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    raise ImportError(
        "hookprof.integrations.lightning needs Lightning: pip install lightning"
    ) from None

from hookprof.integrations.scalars import ProfiledTraining


class HookprofCallback(ProfiledTraining, pl.Callback):
    """Attaches hookprof to the LightningModule when fit starts, on every rank, and detaches
    it when fit ends, fails or is interrupted.

    `HookprofCallback(sample_every=50, ...)`: Config fields, `profiler` and `last_logged` as
    in ProfiledTraining.

    The loss: at the end of each optimizer step (the batch whose `on_train_batch_end` sees
    `trainer.global_step` move) the step's loss goes to `prof.step(loss)`: `outputs["loss"]`
    of its batches added up (under automatic optimization Lightning has divided each by
    `accumulate_grad_batches`, so the sum is their mean; it is the loss before any precision
    plugin's scaling), or, under manual optimization, the mean of what training_step returned
    since the previous step. hookprof then exports it (`hookprof_loss`) and counts a
    non-finite one.

    Rows (integrations/scalars.py, read from the published snapshot with no wait): whenever a
    sampled step was published or a counter changed, every logger of the trainer gets
    `hookprof/nonfinite_steps/<phase>`, `hookprof/skipped_steps`, `hookprof/step_time_s`
    (mean of the steps since the previous row) and, with a new sampled step,
    `hookprof/grad_norm_after_clip` and `hookprof/sampled_step`, at the step the counters
    describe; the final counts are logged when fit ends or fails. Loggers log on rank 0
    only, as Lightning's do.
    """

    _global_step = 0  # Lightning's step count when the last optimizer step ended

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after strategy.setup: parameters are on their device (hookprof picks its timer from
        # them), and pl_module is the LightningModule itself, not its DDP wrapper
        self._attach(pl_module)
        self._global_step = trainer.global_step  # (resumed from a checkpoint: not 0)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.loss.add(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
        if trainer.global_step != self._global_step:  # an optimizer step ended with this batch
            self._global_step = trainer.global_step
            self._end_step(mean=not pl_module.automatic_optimization)
        self._log(trainer, flush=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # note: flush waits for the publisher (and, on a GPU, the device): once per fit
        self._log(trainer, flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # the loggers are still open (Lightning finalizes them after this hook): they get the
        # last sample, often what explains the failure
        try:
            self._log(trainer, flush=True)
        finally:
            self._detach()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()  # idempotent: on_fit_end has normally run

    def _log(self, trainer: pl.Trainer, *, flush: bool) -> None:
        taken = self._take(flush=flush)
        if taken is None:
            return
        step, scalars = taken
        # the loggers themselves, not pl_module.log: that one hands values over every
        # log_every_n_steps (50 by default) at Lightning's step; this way each change
        # reaches them once, at the step it belongs to (Lightning's global_step, hookprof's
        # step: one per optimizer step)
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
