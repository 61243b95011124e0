"""A Hugging Face `TrainerCallback` that attaches hookprof for each `Trainer.train` and adds
its headline scalars to the trainer's logs.

    from hookprof.integrations.huggingface import HookprofTrainerCallback, HookprofTrainerMixin

    class MyTrainer(HookprofTrainerMixin, Trainer):  # optional: see below
        pass

    trainer = MyTrainer(model, args, train_dataset=data, callbacks=[HookprofTrainerCallback()])

Not needed for correct data: `hookprof.attach(model)` before `train()` measures the same.

Where the scalars go, as transformers (5.23) is written (trainer.py, Trainer.log;
trainer_callback.py, CallbackHandler): `Trainer.log` appends a copy of `logs` to
`state.log_history`, then calls each callback's `on_log` in order, the `report_to`
integrations (TensorBoard, W&B, MLflow, ...) first and the callbacks given to the Trainer
after them. A callback's `on_log` therefore comes too late for both; the callback adds its
scalars to the `log_history` entry and to `logs` (for the callbacks after it, the console
printer included). To have every `report_to` integration receive them, mix
`HookprofTrainerMixin` into the Trainer class: its `log` adds them before anything sees the
logs (transformers' documented way: "Subclass and override this method to inject custom
behavior").

The loss reaches hookprof through the mixin too: a callback is never handed the loss (nor the
Trainer), and `on_log`'s loss is a mean over `logging_steps` with NaN and Inf filtered out
(`logging_nan_inf_filter`). The mixin's `training_step` keeps what Trainer.training_step
returns, the micro-batch's loss as Trainer scales it for its own logged loss (divided by the
accumulation steps unless the model or `compute_loss_func` already normalised it by
`num_items_in_batch`; averaged over GPUs under DataParallel); the callback adds those up and
hands the sum, the optimizer step's loss, to `prof.step(loss)` at `on_step_end`. Without the
mixin hookprof counts steps at the optimizer, as for any loop, and has no loss."""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "hookprof.integrations.huggingface needs transformers: pip install transformers"
    ) from None

from hookprof.integrations.scalars import ProfiledTraining


class HookprofTrainerCallback(ProfiledTraining, TrainerCallback):
    """Attaches hookprof to the model at `on_train_begin` and detaches it at `on_train_end`.

    `HookprofTrainerCallback(sample_every=50, ...)`: Config fields, `profiler` and
    `last_logged` as in ProfiledTraining.

    At each log, hookprof's counters as of that step are added (`hookprof/nonfinite_steps/
    <phase>`, `hookprof/skipped_steps`, `hookprof/step_time_s`: the mean of the steps since
    the previous log) and, when a sampled step is new since the previous log, its
    `hookprof/grad_norm_after_clip` (Trainer's `grad_norm` is before clipping) with
    `hookprof/sampled_step`, the step it was read at. With HookprofTrainerMixin, each
    optimizer step's loss goes to hookprof (module docstring)."""

    def scalars(self) -> dict[str, float]:
        """The scalars as of now ({} when no step is new since the last call)."""
        # note: flush waits for hookprof's publisher (on a GPU, for the device); Trainer has
        # just synced for its own loss (`.item()`) at every log, so this adds little
        taken = self._take(flush=True, always=True)
        return taken[1] if taken is not None else {}

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        # `model` is Trainer.model, the model itself, never its DDP/DeepSpeed wrapper
        self._attach(model)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.loss.parts:  # the mixin handed this step's losses over
            self._end_step()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        scalars = self.scalars()
        if not scalars or logs is None:
            return
        logs.update(scalars)  # the callbacks after this one
        if state.log_history:
            state.log_history[-1].update(scalars)  # Trainer.log appended a copy of logs there

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._detach()


class HookprofTrainerMixin:
    """Mixed into a `transformers.Trainer` subclass (before Trainer), adds hookprof's scalars
    to `logs` before `Trainer.log` hands them to `log_history` and every `report_to`
    integration, and hands each micro-batch's loss to the callback (module docstring). Needs a
    HookprofTrainerCallback among the trainer's callbacks."""

    def _hookprof_callbacks(self) -> list[HookprofTrainerCallback]:
        return [
            c
            for c in self.callback_handler.callbacks  # type: ignore[attr-defined]  # a Trainer's
            if isinstance(c, HookprofTrainerCallback)
        ]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]  # mixed into a Trainer
        for callback in self._hookprof_callbacks():
            callback.loss.add(loss)  # (detached by Trainer; added on the device, no wait)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        for callback in self._hookprof_callbacks():
            logs.update(callback.scalars())
        super().log(logs, *args, **kwargs)  # type: ignore[misc]  # mixed into a Trainer
