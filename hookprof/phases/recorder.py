"""The step's phases, host and device, as one object: what the step's boundaries write to.

Owns: the host's `Progress` (every step: where the training thread is, the time per phase)
and, with a device timer, the device marks of sampled steps (`PhaseMarks`, phases/device.py).
The profiler tells it each phase change and each step's end; `bind(record)` at a step's
start says whether this step is marked on the device too. So the choice "host only, or host
and device" is made once per step, here, not at every boundary.

Called by: the `Profiler` on the training thread. Read by: the stall watch (`progress`), the
publisher (the step's record carries the device marks).
"""

from __future__ import annotations

from typing import Any

from hookprof.device.timing import Timer
from hookprof.phases.clock import OUTSIDE, Progress, Where
from hookprof.phases.device import DevicePhaseTotals, PhaseMarks


class PhaseClock:
    """Host phases every step; device marks on sampled steps with a device timer."""

    __slots__ = ("progress", "_marks", "enter", "restart", "end_step", "bound")

    def __init__(self, now_ns: int, timer: Timer):
        self.progress = Progress(now_ns)
        # device time per phase needs a device timer: on the host clock it would repeat
        # hookprof_step_phase_seconds
        self._marks = PhaseMarks(self.progress, timer) if timer.kind == "cuda" else None
        self._write_to(self.progress)

    def _write_to(self, writer: Progress | PhaseMarks) -> None:
        """The step's phase changes go straight to `writer`'s methods: `enter(phase, now_ns,
        label=None)`, `restart(now_ns)`, `end_step(number, now_ns)`. Bound once per step,
        not looked up through this object at each of the step's boundaries (one Python
        call each instead of two: they run on every step, DESIGN.md invariant 11)."""
        self.enter = writer.enter
        self.restart = writer.restart
        self.end_step = writer.end_step
        # writing to device marks: a step without a record must bind (back to the host's
        # progress); while False an unsampled step needs no bind() call at all
        self.bound = writer is not self.progress

    def device_totals(self) -> DevicePhaseTotals | None:
        """The publisher's sums of device phase seconds, when there are device marks."""
        return DevicePhaseTotals() if self._marks is not None else None

    def bind(self, record: Any) -> None:
        """A step begins: a sampled step's `record` (None for an unsampled one) gets the
        device marks; others write the host's progress alone, at no extra cost."""
        writer = (
            self.progress if record is None or self._marks is None else self._marks.bind(record)
        )
        # (an unsampled step after another: unchanged)
        if self.enter.__self__ is not writer:  # type: ignore[attr-defined]
            self._write_to(writer)

    @property
    def where(self) -> Where:
        return self.progress.where

    def outside(self, what: str, now_ns: int) -> tuple[int, int, str | None]:
        """Enter a known long section (`expect_slow`); returns where to come back to."""
        step, phase, _, label = self.progress.where
        self.enter(OUTSIDE, now_ns, what)
        return step, phase, label

    def back(self, where: tuple[int, int, str | None], now_ns: int) -> None:
        """Leave a section entered by `outside`, unless the step ended inside it."""
        step, phase, label = where
        if self.progress.where[0] == step:
            self.enter(phase, now_ns, label)
