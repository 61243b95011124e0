"""A Lightning callback that attaches hookprof for each `Trainer.fit` and logs its headline
scalars through the trainer's loggers.

    from hookprof.integrations.lightning import HookprofCallback
    trainer = L.Trainer(callbacks=[HookprofCallback(sample_every=50)])

Not needed for correct data: `hookprof.attach(lightning_module)` before `fit` measures the
same; the callback only lets the trainer own attach and detach, and logs."""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    raise ImportError("hookprof.integrations.lightning needs Lightning: pip install lightning") from None

from hookprof.integrations.scalars import ProfiledTraining


class HookprofCallback(ProfiledTraining, pl.Callback):
    """Attaches hookprof to the LightningModule when fit starts, on every rank, and detaches
    it when fit ends, fails or is interrupted.

    `HookprofCallback(sample_every=50, ...)`: Config fields, `profiler` and `last_logged` as
    in ProfiledTraining.

    After each sampled step (at most once per step, read from the published snapshot with no
    wait) every logger of the trainer gets `hookprof/grad_norm`,
    `hookprof/nonfinite_steps/<phase>`, `hookprof/skipped_steps` and `hookprof/step_time_s`
    (mean of the steps since the previous log), at hookprof's sampled step; the last sample
    is logged when training ends or fails. Loggers log on rank 0 only, as Lightning's do.
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after strategy.setup: parameters are on their device (hookprof picks its timer from
        # them), and pl_module is the LightningModule itself, not its DDP wrapper
        self._attach(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, flush=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # note: flush waits for the publisher (and, on a GPU, the device): once per fit
        self._log(trainer, flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
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
        # log_every_n_steps (50 by default) at Lightning's step; this way each sampled step
        # reaches them once, at the step it belongs to
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
