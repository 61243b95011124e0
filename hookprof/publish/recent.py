"""Each layer's recent time per call, robust to one slow call: what the layer straggler rule
compares across ranks (issue 42).

Prometheus can compare ranks only through what each rank exports. Cumulative sums and counts
give a rate over a window of minutes, and a statistic robust to one preempted call needs
several such windows (a low quartile of one-minute means over 3 minutes): a slowdown was named
4.5 minutes after it began. Each rank knows its own last sampled steps, so it exports the
median of their per-call means: one call 50x the others (the host preempted, a GC pause)
moves the median of five by nothing, a slowdown that lasts moves it after three sampled steps
(three sampling intervals: the larger of `sample_every` steps and `min_sample_interval_s`,
~6 s for steps under 0.2 s, rounded up to a power of two of steps where ranks align), and the
rule compares it across ranks at once. Ranks sample the same step numbers (step/plan.py), so
the ranks' medians are over the same steps, give or take the one a scrape falls between (a
layer that runs on some steps only: over the steps that called it, and none once it has not
run for STALE_AFTER sampled steps). A rank that stops sampling altogether keeps its last
medians on its page; the stall alerts are what names it then (docs/stalls.md).
"""

from __future__ import annotations

from collections import deque
from statistics import median

# sampled steps per median: robust to two slow ones of five; three sampled steps move it
RECENT_SAMPLES = 5
# a row not called in this many sampled steps has no recent median (a layer that runs on some
# steps only, an expert of a mixture, an eval-only head): its last one would be exported
# forever, and keep a straggler alert firing or a rank in the median of ranks. A layer called
# on one sampled step of two still has five calls within it
STALE_AFTER = 2 * RECENT_SAMPLES


class RecentPerCall:
    """Per row (a layer, or a compiled region's row), the mean time per call of its last
    `RECENT_SAMPLES` sampled steps that called it, and the sampled step of the last one."""

    def __init__(self, rows: int):
        self._rows: list[deque[float]] = [deque(maxlen=RECENT_SAMPLES) for _ in range(rows)]
        self._last = [0] * rows  # the sampled step (counted here) that last called each row
        self._sampled = 0

    def add(self, seconds: list[float], calls: list[int]) -> None:
        """A sampled step's seconds and calls per row (rows it did not call keep theirs)."""
        self._sampled += 1
        for k, (row, total, n) in enumerate(zip(self._rows, seconds, calls)):
            if n:
                row.append(total / n)
                self._last[k] = self._sampled

    def median(self, row: int) -> float | None:
        """The median per call over the last RECENT_SAMPLES sampled steps that called the
        row; None until there are that many, and once the row has not been called in the
        last STALE_AFTER sampled steps."""
        values = self._rows[row]
        if len(values) < RECENT_SAMPLES or self._sampled - self._last[row] >= STALE_AFTER:
            return None
        return median(values)
