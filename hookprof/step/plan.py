"""The once-per-step decisions: is the next step sampled, and does it check layer outputs?"""

from __future__ import annotations

from typing import NamedTuple

# the longest aligned period, in steps (2^30: never reached by a real run's step time)
_MAX_PERIOD = 1 << 30


def aligned_period(every: int, min_interval_ns: int, step_ns: float, period: int) -> int:
    """The next sampling period of aligned ranks, from the current `period`: `every` times a
    power of two whose steps, at `step_ns` each, last `min_interval_ns`. Doubled while they
    last less; halved only when half of it lasts twice the interval (a slowed run): near a
    boundary, the step time's noise would otherwise move the ranks' periods apart at
    different samples. A power of two, so that two ranks whose periods differ still share
    every other sampled step."""
    while period * step_ns < min_interval_ns and period < _MAX_PERIOD:
        period *= 2
    while period > every and period // 2 * step_ns >= 2 * min_interval_ns:
        period //= 2
    return period


class Sampler:
    """A step is sampled when at least `every` steps and `min_interval_s` seconds have passed
    since the last sampled step. The first step is always sampled so metrics appear at once.

    `aligned` (a process that is one rank of several): the sampled steps are the multiples of
    a period of steps (`aligned_period`: `every` times a power of two, from the step time
    measured between two samples), so that ranks in step with each other sample the same
    step numbers and compare the same steps' layer times (issue 42); the interval is kept
    on average rather than to the step."""

    __slots__ = (
        "every",
        "min_interval_ns",
        "aligned",
        "period",
        "_last_step",
        "_last_ns",
        "_first",
    )

    def __init__(self, every: int, min_interval_s: float, aligned: bool = False):
        self.every = every
        self.min_interval_ns = int(min_interval_s * 1e9)
        self.aligned = aligned
        self.period = every  # aligned: the sampled steps are its multiples
        self._last_step: int | None = None
        self._last_ns = 0
        self._first = (0, 0)  # aligned: (step, ns) of the first sample, the estimate's origin

    def skips(self, step: int, now_ns: int) -> bool:
        """Is `step` (about to start) not sampled, the first step having been?"""
        if self.aligned:
            return step % self.period != 0
        last = self._last_step or 0
        return step - last < self.every or now_ns - self._last_ns < self.min_interval_ns

    def should_sample(self, step: int, now_ns: int) -> bool:
        """`step` is the index of the step about to start; `now_ns` a perf_counter_ns."""
        last = self._last_step
        if last is not None and self.skips(step, now_ns):
            return False
        if self.aligned:
            if last is None:
                self._first = (step, now_ns)
            elif step > self._first[0]:
                # the mean step time since the first sample: ranks in step with each other
                # estimate nearly the same, and it moves slowly, so they change the period
                # at the same sampled step (the last window alone would differ by its noise)
                first_step, first_ns = self._first
                self.period = aligned_period(
                    self.every,
                    self.min_interval_ns,
                    (now_ns - first_ns) / (step - first_step),
                    self.period,
                )
        self._last_step = step
        self._last_ns = now_ns
        return True


class StepPlan(NamedTuple):
    """What one step records beyond the every-step checks."""

    sampled: bool  # per-layer timing hooks on, gradient norms read
    checked: bool  # also per-layer output checks (activation statistics)


UNSAMPLED = StepPlan(False, False)


class StepPlanner:
    """Sampling, plus the separate rate limit of activation statistics
    (`activation_interval_s`). An open incident (a NaN/Inf whose layer is not known yet)
    samples and checks every step. A fault in hookprof's own per-layer hooks does not change
    the plan (DESIGN.md invariant 3): the step keeps its gradient norms and NaN checks, only
    its per-layer hooks stay out (SampledStep.begin)."""

    def __init__(
        self,
        every: int,
        min_interval_s: float,
        activation_stats: bool,
        activation_interval_s: float,
        aligned: bool = False,
    ):
        self._sampler = Sampler(every, min_interval_s, aligned)
        self._activation_stats = activation_stats
        self._check_interval_ns = int(activation_interval_s * 1e9)
        self._last_checked_ns = -(1 << 62)

    def plan(self, step: int, now_ns: int, *, incident: bool) -> StepPlan:
        sampler = self._sampler
        if (
            not incident
            and sampler._last_step is not None
            and (
                (step % sampler.period != 0)
                if sampler.aligned
                else (
                    step - sampler._last_step < sampler.every
                    or now_ns - sampler._last_ns < sampler.min_interval_ns
                )
            )
        ):
            return UNSAMPLED  # should_sample's "no" (skips), inline: the usual step, one call less
        sampled = sampler.should_sample(step, now_ns) or incident
        checked = (
            sampled
            and self._activation_stats
            and (incident or now_ns - self._last_checked_ns >= self._check_interval_ns)
        )
        if checked:
            self._last_checked_ns = now_ns
        return StepPlan(sampled, checked)
