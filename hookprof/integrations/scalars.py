"""The headline scalars both trainer integrations log: one place decides their names and
values, and hands each sampled step out once."""

from __future__ import annotations

from ..snapshot import PHASES, Snapshot

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


class SampledSteps:
    """Reads a profiler's latest snapshot and hands out its scalars once per sampled step.

    `snapshot()` never waits (the background thread publishes it), so a trainer's batch-end
    hook can call `take()` every step; it returns something only when the snapshot shows a
    sampled step that was not handed out yet."""

    def __init__(self, profiler):
        self.profiler = profiler
        self.taken: Snapshot | None = None
        """The snapshot whose scalars were handed out last."""

    def take(self, *, flush: bool = False) -> tuple[int, dict[str, float]] | None:
        """(the sampled step, its scalars), or None when no new sampled step has been
        published. `flush=True` first waits for the publisher (at the end of training)."""
        if flush and not self.profiler.detached:
            self.profiler.flush()
        snap = self.profiler.snapshot()
        step = snap.last_sampled_step
        last = self.taken.last_sampled_step if self.taken is not None else None
        if step is None or step == last:
            return None
        scalars = headline(snap, self.taken)
        self.taken = snap
        return step, scalars
