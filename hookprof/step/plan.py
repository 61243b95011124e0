"""The once-per-step decisions: is the next step sampled, and does it check layer outputs?"""

from __future__ import annotations

from typing import NamedTuple


class Sampler:
    """A step is sampled when at least `every` steps and `min_interval_s` seconds have passed
    since the last sampled step. The first step is always sampled so metrics appear at once.
    """

    __slots__ = ("every", "min_interval_ns", "_last_step", "_last_ns")

    def __init__(self, every: int, min_interval_s: float):
        self.every = every
        self.min_interval_ns = int(min_interval_s * 1e9)
        self._last_step: int | None = None
        self._last_ns = 0

    def should_sample(self, step: int, now_ns: int) -> bool:
        """`step` is the index of the step about to start; `now_ns` a perf_counter_ns."""
        if self._last_step is not None and (
            step - self._last_step < self.every or now_ns - self._last_ns < self.min_interval_ns
        ):
            return False
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
    ):
        self._sampler = Sampler(every, min_interval_s)
        self._activation_stats = activation_stats
        self._check_interval_ns = int(activation_interval_s * 1e9)
        self._last_checked_ns = -(1 << 62)

    def plan(self, step: int, now_ns: int, *, incident: bool) -> StepPlan:
        sampler = self._sampler
        if (
            not incident
            and sampler._last_step is not None
            and (
                step - sampler._last_step < sampler.every
                or now_ns - sampler._last_ns < sampler.min_interval_ns
            )
        ):
            return UNSAMPLED  # should_sample's "no", inline: the usual step, one call less
        sampled = sampler.should_sample(step, now_ns) or incident
        checked = (
            sampled
            and self._activation_stats
            and (incident or now_ns - self._last_checked_ns >= self._check_interval_ns)
        )
        if checked:
            self._last_checked_ns = now_ns
        return StepPlan(sampled, checked)
