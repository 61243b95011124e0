"""The once-per-step decision: is the next step a sampled one?"""

from __future__ import annotations


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
