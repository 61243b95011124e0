"""Where the training thread is: the step in progress, its phase, since when; and the time
each step spent in each phase.

The training thread calls `enter(phase, now)` at the boundaries it already watches (the root
module's forward pre-hook and output hook, the optimizer's pre- and post-hooks, the return of
an optimizer closure, the step's end), with the clock reading it takes there anyway. Each call
is a subtraction, one list add and one tuple store: the stall watch (watchdog.py) and the
publisher read `where`, `last_step` and `totals` from their own threads, and every one of
them is replaced whole, never changed in place, so a reader sees one consistent value.

Phases of one step (docs/stalls.md, "What the phases are"):

    data       the previous step's end to the step's first training forward of the root
    forward    the root module's training forwards (pre-hook to output)
    backward   a root output to the next root forward, the optimizer's pre-hook, the return
               of an optimizer closure, or the step's end
    optimizer  an owned optimizer's pre-hook to its post-hook (in a closure step, minus the
               forwards and backwards the closure ran)
    other      the rest: after the optimizer, until the step ends (zero_grad, a scheduler,
               logging before prof.step()), and work outside the step (below)

`OUTSIDE` (evaluation forwards, `Profiler.expect_slow` sections, the time before the first
step) is never judged by the stall watch; the step-phase totals count it as `other`, so that
the phases of a step add up to its duration (hookprof_step_duration_seconds).
"""

from __future__ import annotations

from typing import NamedTuple

PHASES = ("data", "forward", "backward", "optimizer", "other")
DATA, FORWARD, BACKWARD, OPTIMIZER, OTHER = range(len(PHASES))
OUTSIDE = len(PHASES)  # outside a step: never a stall
OUTSIDE_NAME = "outside"


def phase_name(phase: int) -> str:
    return PHASES[phase] if phase < OUTSIDE else OUTSIDE_NAME


class Where(NamedTuple):
    """The training thread's position, replaced whole at every boundary."""

    step: int  # the step in progress (steps completed + 1)
    phase: int  # index in PHASES, or OUTSIDE
    since_ns: int  # the clock reading at which this phase began
    label: str | None = None  # what an OUTSIDE section is ("eval", expect_slow's name)


class Progress:
    """Written by the training thread only; read by any thread."""

    __slots__ = ("where", "last_step", "totals", "_spent")

    def __init__(self, now_ns: int):
        # before the first step's first forward the model is being set up: outside a step
        self.where = Where(1, OUTSIDE, now_ns, "start")
        self.last_step: tuple[int, tuple[float, ...]] | None = None  # (number, seconds per phase)
        self.totals: tuple[int, tuple[float, ...]] = (0, (0.0,) * len(PHASES))  # (steps, sums)
        self._spent = [0] * (OUTSIDE + 1)  # ns per phase in the step in progress

    def enter(self, phase: int, now_ns: int, label: str | None = None) -> None:
        """The training thread moves to `phase` at `now_ns`."""
        where = self.where
        self._spent[where.phase] += now_ns - where.since_ns
        self.where = Where(where.step, phase, now_ns, label)

    def restart(self, now_ns: int) -> None:
        """The step's clock starts now (the first step's first forward): what was spent
        before is not part of any step."""
        self._spent = [0] * (OUTSIDE + 1)
        self.where = self.where._replace(since_ns=now_ns)

    def end_step(self, number: int, now_ns: int) -> None:
        """Step `number` ended at `now_ns`: fold its phases into the totals; the next step
        waits for its data."""
        spent = self._spent
        spent[self.where.phase] += now_ns - self.where.since_ns
        spent[OTHER] += spent[OUTSIDE]
        seconds = (spent[DATA] * 1e-9, spent[FORWARD] * 1e-9, spent[BACKWARD] * 1e-9,
                   spent[OPTIMIZER] * 1e-9, spent[OTHER] * 1e-9)
        steps, sums = self.totals
        self.totals = (steps + 1, tuple(a + b for a, b in zip(sums, seconds)))
        self.last_step = (number, seconds)
        self._spent = [0] * (OUTSIDE + 1)
        self.where = Where(number + 1, DATA, now_ns)
