"""Each layer's recent time per call, robust to one slow call: what the layer straggler rule
compares across ranks (issue 42).

Prometheus can compare ranks only through what each rank exports. Cumulative sums and counts
give a rate over a window of minutes, and a statistic robust to one preempted call needs
several such windows (a low quartile of one-minute means over 3 minutes): a slowdown was named
4.5 minutes after it began. Each rank knows its own last sampled steps, so it exports the
median of their per-call means: one call 50x the others (the host preempted, a GC pause)
moves the median of five by nothing, a slowdown that lasts moves it after three sampled steps
(~6 s at the default 2 s between samples), and the rule compares it across ranks at once.
Ranks sample the same step numbers (step/plan.py), so the ranks' medians are over the same
steps, give or take the one a scrape falls between.
"""

from __future__ import annotations

from collections import deque
from statistics import median

# sampled steps per median: robust to two slow ones of five; three sampled steps move it
RECENT_SAMPLES = 5


class RecentPerCall:
    """Per row (a layer, or a compiled region's row), the mean time per call of its last
    `RECENT_SAMPLES` sampled steps that called it."""

    def __init__(self, rows: int):
        self._rows: list[deque[float]] = [deque(maxlen=RECENT_SAMPLES) for _ in range(rows)]

    def add(self, seconds: list[float], calls: list[int]) -> None:
        """A sampled step's seconds and calls per row (rows it did not call keep theirs)."""
        for row, (total, n) in zip(self._rows, zip(seconds, calls)):
            if n:
                row.append(total / n)

    def median(self, row: int) -> float | None:
        """The median per call over the last RECENT_SAMPLES sampled steps that called the
        row; None until there are that many."""
        values = self._rows[row]
        return median(values) if len(values) == RECENT_SAMPLES else None
