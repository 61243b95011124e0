"""What both trainer integrations share: the headline scalars they log (one place decides
their names and values), the profiler they own for a training run, and the loss of each
optimizer step, handed to hookprof at the step's end.

Rows: a row is logged when a sampled step was published or a counter changed since the last
row (and once more when training ends), at `snap.step`, the step its counters describe. The
gradient norm is a sampled step's: it comes with `hookprof/sampled_step`, the step it was read
at, and is named `grad_norm_after_clip` because it is the norm of the gradients the update
read, after the trainer's clipping (Lightning's and transformers' own `grad_norm` is before
it): docs/compatibility.md."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from hookprof.profiler import DisabledProfiler, Profiler, attach
from hookprof.snapshot import PHASES, Snapshot

PREFIX = "hookprof/"
GRAD_NORM = PREFIX + "grad_norm_after_clip"
SAMPLED_STEP = PREFIX + "sampled_step"


def step_count(snap: Snapshot) -> int:
    """Steps whose duration is in `step_duration_sum` (the histogram's +Inf bucket)."""
    return snap.step_duration_buckets[-1][1] if snap.step_duration_buckets else 0


def counters(snap: Snapshot) -> dict[str, float]:
    """The non-finite steps per phase and the skipped steps so far."""
    scalars = {
        f"{PREFIX}nonfinite_steps/{phase}": float(snap.nonfinite_steps[phase]) for phase in PHASES
    }
    scalars[PREFIX + "skipped_steps"] = float(snap.skipped_steps)
    return scalars


def new_sample(snap: Snapshot, previous: Snapshot | None) -> bool:
    return snap.last_sampled_step is not None and (
        previous is None or snap.last_sampled_step != previous.last_sampled_step
    )


def headline(snap: Snapshot, previous: Snapshot | None = None) -> dict[str, float]:
    """The scalars a trainer's loggers get from `snap`: the counters, the mean step time of
    the steps since `previous` (since the start without one), and, when `snap` has a sampled
    step `previous` had not, that step's global gradient norm and its number. A figure
    hookprof does not have (no gradient norm yet, no step timed since `previous`) is left
    out, never logged as zero."""
    scalars = counters(snap)
    if new_sample(snap, previous) and snap.grad_norm is not None:
        scalars[GRAD_NORM] = snap.grad_norm
        scalars[SAMPLED_STEP] = float(snap.last_sampled_step or 0)  # (a new sample: set)
    before_sum, before_count = (
        (previous.step_duration_sum, step_count(previous)) if previous else (0.0, 0)
    )
    timed = step_count(snap) - before_count
    if timed > 0:
        scalars[PREFIX + "step_time_s"] = (snap.step_duration_sum - before_sum) / timed
    return scalars


class StepLoss:
    """The loss of the optimizer step in progress: its micro-batches' losses added on the
    device (nothing waits for it), as the trainers add them for their own logged loss."""

    def __init__(self) -> None:
        self.total: Any = None
        self.parts = 0

    def add(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach()
        elif not isinstance(loss, numbers.Real):
            return  # not a loss (None: the step returned none)
        self.total = loss if self.total is None else self.total + loss
        self.parts += 1

    def take(self, *, mean: bool = False) -> Any:
        """The sum (or mean) of the losses since the last take; None when none was added."""
        total, parts = self.total, self.parts
        self.total, self.parts = None, 0
        return total / parts if mean and parts > 1 else total


class ProfiledTraining:
    """What both callbacks share: the profiler they attach for each training run, the
    scalars of its snapshots (each sampled step handed out once), and the step's loss.

    Keyword arguments are `hookprof.Config` fields, as for `hookprof.attach`. `profiler` is
    the profiler of the current (or last) run: its `snapshot()` stays readable after detach."""

    def __init__(self, **config_overrides: Any):
        self.config_overrides = config_overrides
        self.profiler: Profiler | DisabledProfiler | None = None
        self.last_logged: Snapshot | None = None  # the snapshot whose scalars were handed out last
        self.loss = StepLoss()

    def _attach(self, model: nn.Module) -> None:
        self._detach()  # a run that failed without telling its callbacks
        self.profiler = attach(model, **self.config_overrides)
        self.last_logged = None
        self.loss = StepLoss()

    def _detach(self) -> None:
        if self.profiler is not None:
            self.profiler.detach()

    def _end_step(self, *, mean: bool = False) -> None:
        """An optimizer step ended: hand its loss to hookprof (`prof.step(loss)`: from then on
        these calls end hookprof's steps, one per optimizer step, as in a plain loop)."""
        loss = self.loss.take(mean=mean)
        if self.profiler is not None and not self.profiler.detached:
            self.profiler.step(loss)

    def _take(self, *, flush: bool, always: bool = False) -> tuple[int, dict[str, float]] | None:
        """(the step the counters describe, the scalars), or None when nothing changed since
        the last call: no new sampled step, the same counters (and, at the end of training,
        `flush=True`, no new step). `snapshot()` never waits (the background thread publishes
        it), so a trainer's batch-end hook can call this every step; `flush=True` first waits
        for the publisher. `always`: a row whenever some step is new (a trainer's log)."""
        if self.profiler is None or self.profiler.detached:
            return None
        if flush:
            self.profiler.flush()
        snap = self.profiler.snapshot()
        previous = self.last_logged
        if snap.step == 0:
            return None
        if (
            previous is not None
            and not new_sample(snap, previous)
            and counters(snap) == counters(previous)
        ):
            if not (flush or always) or snap.step == previous.step:
                return None
        self.last_logged = snap
        return snap.step, headline(snap, previous)
