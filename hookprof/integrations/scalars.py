"""What both trainer integrations share: the headline scalars they log (one place decides
their names and values) and the profiler they own for a training run, whose sampled steps
they hand out once each."""

from __future__ import annotations

from typing import Any

from torch import nn

from hookprof.profiler import DisabledProfiler, Profiler, attach
from hookprof.snapshot import PHASES, Snapshot

PREFIX = "hookprof/"


def step_count(snap: Snapshot) -> int:
    """Steps whose duration is in `step_duration_sum` (the histogram's +Inf bucket)."""
    return snap.step_duration_buckets[-1][1] if snap.step_duration_buckets else 0


def headline(snap: Snapshot, previous: Snapshot | None = None) -> dict[str, float]:
    """The scalars a trainer's loggers get from `snap`: the global gradient norm of its last
    sampled step, the non-finite steps per phase and the skipped steps so far, and the mean
    step time of the steps since `previous` (since the start without one). A figure hookprof
    does not have (no gradient norm yet, no step timed since `previous`) is left out, never
    logged as zero."""
    scalars: dict[str, float] = {}
    if snap.grad_norm is not None:
        scalars[PREFIX + "grad_norm"] = snap.grad_norm
    for phase in PHASES:
        scalars[f"{PREFIX}nonfinite_steps/{phase}"] = float(snap.nonfinite_steps[phase])
    scalars[PREFIX + "skipped_steps"] = float(snap.skipped_steps)
    before_sum, before_count = (previous.step_duration_sum, step_count(previous)) if previous else (0.0, 0)
    timed = step_count(snap) - before_count
    if timed > 0:
        scalars[PREFIX + "step_time_s"] = (snap.step_duration_sum - before_sum) / timed
    return scalars


class ProfiledTraining:
    """What both callbacks share: the profiler they attach for each training run, and the
    scalars of its sampled steps, each sampled step handed out once.

    Keyword arguments are `hookprof.Config` fields, as for `hookprof.attach`. `profiler` is
    the profiler of the current (or last) run: its `snapshot()` stays readable after detach."""

    def __init__(self, **config_overrides: Any):
        self.config_overrides = config_overrides
        self.profiler: Profiler | DisabledProfiler | None = None
        self.last_logged: Snapshot | None = None  # the snapshot whose scalars were handed out last

    def _attach(self, model: nn.Module) -> None:
        self._detach()  # a run that failed without telling its callbacks
        self.profiler = attach(model, **self.config_overrides)
        self.last_logged = None

    def _detach(self) -> None:
        if self.profiler is not None:
            self.profiler.detach()

    def _take(self, *, flush: bool) -> tuple[int, dict[str, float]] | None:
        """(the sampled step, its scalars), or None when no sampled step has been published
        since the last call. `snapshot()` never waits (the background thread publishes it),
        so a trainer's batch-end hook can call this every step; `flush=True` first waits for
        the publisher."""
        if self.profiler is None or self.profiler.detached:
            return None
        if flush:
            self.profiler.flush()
        snap = self.profiler.snapshot()
        step = snap.last_sampled_step
        if step is None or (self.last_logged is not None and step == self.last_logged.last_sampled_step):
            return None
        scalars = headline(snap, self.last_logged)
        self.last_logged = snap
        return step, scalars
