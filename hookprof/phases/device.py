"""Device time per step phase on sampled steps, when the timer is a device timer (CUDA).

On the training thread, `PhaseMarks` stands in for the `Progress` record during a sampled
step: each phase boundary the host passes (progress.py: the root forward, its output, the
optimizer's pre- and post-hooks, a closure's return, an evaluation or expect_slow section,
the step's end) is passed on to `Progress` and also marked on the timer: one pooled CUDA
event recorded on the step's stream, kept as (phase entered, token) in the step's record.
Unsampled steps never see this class: the profiler calls `Progress` itself then.

On the publisher thread, `device_phase_seconds` turns one step's marks, resolved with the
step's other tokens (one wait per step), into device seconds per phase, and
`DevicePhaseTotals` sums them over sampled steps.

What the figures mean (docs/stalls.md, "Device time per phase"): an event's time is when
the stream reached it: when the work enqueued before it had finished, or, if the stream was
idle by then, when the host enqueued it. A phase's device time is the stream's progress
between the mark that began it and the mark that ended it: the running of what was enqueued
before the ending mark and not yet run at the beginning one, plus the time the stream idled
waiting for the host. A device-bound loop shows each phase's own kernels; a host-bound one
shows the host's pace, and its `data` is the time the device sat idle while the host
fetched the batch (the part of the data wait that queued work did not hide).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from hookprof.device.timing import Timer
from hookprof.phases.clock import DATA, OUTSIDE, PHASES, Progress, step_phases
from hookprof.step.record import StepRecord

END = -1  # the step's last mark: its end
RESTART = (
    -2
)  # the step's clock restarted (the first step's first forward): earlier marks do not count


class PhaseMarks:
    """`Progress`'s writing surface for a sampled step, marking the timer at each boundary.
    Used on the training thread only; `record` is the sampled step's record."""

    __slots__ = ("_progress", "_mark", "record")

    def __init__(self, progress: Progress, timer: Timer):
        self._progress = progress
        self._mark = timer.mark
        self.record: Any = None  # the sampled step's StepRecord, once bound

    def bind(self, record: StepRecord) -> PhaseMarks:
        """Mark into `record` (a sampled step's) from now on."""
        self.record = record
        return self

    def enter(self, phase: int, now_ns: int, label: str | None = None) -> None:
        self._progress.enter(phase, now_ns, label)
        self.record.phase_marks.append((phase, self._mark()))

    def restart(self, now_ns: int) -> None:
        self._progress.restart(now_ns)
        self.record.phase_marks.append((RESTART, self._mark()))

    def end_step(self, number: int, now_ns: int) -> None:
        # marked before the host's totals are folded: the stream's position at the step's end
        self.record.phase_marks.append((END, self._mark()))
        self._progress.end_step(number, now_ns)


def device_phase_seconds(
    marks: Iterable[tuple[int, Any]], at: Callable[[Any], float]
) -> tuple[float, ...] | None:
    """Device seconds per phase (PHASES order) of one step from its marks, `at(token)` being
    seconds from the record's ref (the step's first mark, at the previous step's end, where
    its `data` begins). None when the step has no end mark (it was not a whole step).
    Mirrors Progress: a stretch between two marks is the phase entered at the first; time
    outside a step (evaluation, expect_slow) counts as `other` (progress.step_phases)."""
    spent = [0.0] * (OUTSIDE + 1)
    current, since, ended = DATA, 0.0, False
    for phase, token in marks:
        t = at(token)
        if phase == RESTART:
            spent = [0.0] * (OUTSIDE + 1)
        else:
            # events of one stream complete in order; max() guards a mark of another stream
            spent[current] += max(t - since, 0.0)
            if phase == END:
                ended = True
                break
            current = phase
        since = t
    if not ended:
        return None
    return step_phases(spent)


class DevicePhaseTotals:
    """Device seconds per phase summed over the sampled steps that had them (publisher thread)."""

    __slots__ = ("steps", "sums")

    def __init__(self) -> None:
        self.steps = 0
        self.sums = [0.0] * len(PHASES)

    def add(self, seconds: tuple[float, ...] | None) -> None:
        if seconds is None:
            return
        self.steps += 1
        for i, s in enumerate(seconds):
            self.sums[i] += s

    def by_phase(self) -> Mapping[str, float]:
        return MappingProxyType(dict(zip(PHASES, self.sums)))
