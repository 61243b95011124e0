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
behavior")."""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "hookprof.integrations.huggingface needs transformers: pip install transformers"
    ) from None

from hookprof.integrations.scalars import PREFIX, ProfiledTraining


class HookprofTrainerCallback(ProfiledTraining, TrainerCallback):
    """Attaches hookprof to the model at `on_train_begin` and detaches it at `on_train_end`.

    `HookprofTrainerCallback(sample_every=50, ...)`: Config fields, `profiler` and
    `last_logged` as in ProfiledTraining.

    At each log the scalars of hookprof's last sampled step, if not logged before, are added:
    `hookprof/grad_norm`, `hookprof/nonfinite_steps/<phase>`, `hookprof/skipped_steps`,
    `hookprof/step_time_s` (mean of the steps since the previous log) and
    `hookprof/sampled_step` (the step they were taken at)."""

    def scalars(self) -> dict[str, float]:
        """The scalars of a sampled step not logged yet ({} when there is none). Each sampled
        step is handed out once."""
        # note: flush waits for hookprof's publisher (on a GPU, for the device); Trainer has
        # just synced for its own loss (`.item()`) at every log, so this adds little
        taken = self._take(flush=True)
        if taken is None:
            return {}
        step, scalars = taken
        return {**scalars, PREFIX + "sampled_step": step}

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        # `model` is Trainer.model, the model itself, never its DDP/DeepSpeed wrapper
        self._attach(model)

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
    integration. Needs a HookprofTrainerCallback among the trainer's callbacks."""

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, HookprofTrainerCallback):
                logs.update(callback.scalars())
        super().log(logs, *args, **kwargs)
