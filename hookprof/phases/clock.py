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

PHASES = ("data", "forward", "backward", "optimizer", "other")
DATA, FORWARD, BACKWARD, OPTIMIZER, OTHER = range(len(PHASES))
OUTSIDE = len(PHASES)  # outside a step: never a stall
OUTSIDE_NAME = "outside"


def phase_name(phase: int) -> str:
    return PHASES[phase] if phase < OUTSIDE else OUTSIDE_NAME


def step_phases(spent: list, scale: float = 1.0) -> tuple[float, ...]:
    """One step's time per phase (PHASES order) from its time in each phase and outside a
    step (`spent`, indexed by phase, OUTSIDE last), times `scale`: time outside a step counts
    as `other`, so that the phases add up to the step's duration. The host's phases
    (Progress, in ns) and the device's (device_phases.py, in seconds) fold by this one rule."""
    data, forward, backward, optimizer, other, outside = spent
    return (
        data * scale,
        forward * scale,
        backward * scale,
        optimizer * scale,
        (other + outside) * scale,
    )


# The training thread's position, replaced whole at every boundary: a plain tuple
# (step in progress, phase index or OUTSIDE, clock reading at which the phase began, label of
# an OUTSIDE section: "eval", "start", expect_slow's name). A NamedTuple costs ~10 clock reads
# to build, a tuple next to nothing: this is built at every boundary of every step.
Where = tuple[int, int, int, "str | None"]


class Progress:
    """Written by the training thread only; read by any thread."""

    __slots__ = ("where", "last_step", "totals", "_spent")

    def __init__(self, now_ns: int):
        # before the first step's first forward the model is being set up: outside a step
        self.where: Where = (1, OUTSIDE, now_ns, "start")
        self.last_step: tuple[int, tuple[float, ...]] | None = None  # (number, seconds per phase)
        self.totals: tuple[int, tuple[float, ...]] = (0, (0.0,) * len(PHASES))  # (steps, sums)
        self._spent = [0] * (OUTSIDE + 1)  # ns per phase in the step in progress

    def enter(self, phase: int, now_ns: int, label: str | None = None) -> None:
        """The training thread moves to `phase` at `now_ns`."""
        step, current, since, _ = self.where
        self._spent[current] += now_ns - since
        self.where = (step, phase, now_ns, label)

    def restart(self, now_ns: int) -> None:
        """The step's clock starts now (the first step's first forward): what was spent
        before is not part of any step."""
        self._spent = [0] * (OUTSIDE + 1)
        step, phase, _, label = self.where
        self.where = (step, phase, now_ns, label)

    def end_step(self, number: int, now_ns: int) -> None:
        """Step `number` ended at `now_ns`: fold its phases into the totals; the next step
        waits for its data."""
        _, current, since, _ = self.where
        spent = self._spent
        spent[current] += now_ns - since
        data, forward, backward, optimizer, other, outside = (
            spent  # step_phases(spent, 1e-9), inline
        )
        seconds = (
            data * 1e-9,
            forward * 1e-9,
            backward * 1e-9,
            optimizer * 1e-9,
            (other + outside) * 1e-9,
        )
        steps, (s_data, s_forward, s_backward, s_optimizer, s_other) = self.totals
        self.totals = (
            steps + 1,
            (
                s_data + seconds[0],
                s_forward + seconds[1],
                s_backward + seconds[2],
                s_optimizer + seconds[3],
                s_other + seconds[4],
            ),
        )
        self.last_step = (number, seconds)
        self._spent = [0, 0, 0, 0, 0, 0]
        self.where = (number + 1, DATA, now_ns, None)
