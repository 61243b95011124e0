"""Axes for the run report's charts: linear and log scales from data to pixels, tick values
a person reads at a glance (1, 2 or 5 times a power of ten, never two alike), and their
labels. Every chart of a model shares one step axis, so that a step lines up down the page."""

from __future__ import annotations

import math

WIDTH = 1200  # the viewBox width of every chart; the page scales it to the window's width
PAD_L, PAD_R = 170, 24  # the left margin holds layer names (heatmap) and y ticks (lines)
NICE = (1.0, 2.0, 2.5, 5.0, 10.0)


class Scale:
    """Linear (or log10) map from [lo, hi] in data to [a, b] in pixels."""

    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool = False):
        self.log = log
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        self.lo, self.hi, self.a, self.b = lo, hi, a, b

    def __call__(self, v: float) -> float:
        if self.log:
            v = math.log10(v)
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    @property
    def domain(self) -> tuple[float, float]:
        return (10**self.lo, 10**self.hi) if self.log else (self.lo, self.hi)


def tick_step(lo: float, hi: float, count: int) -> float:
    """The distance between ticks: the smallest 1/2/2.5/5 x 10^k giving at most `count`
    intervals over [lo, hi]."""
    raw = (hi - lo) / max(count, 1)
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in NICE if m * power >= raw * (1 - 1e-9))


def linear_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Tick values covering [lo, hi]: the first at or below lo, the last at or above hi, so
    the axis is drawn from the first tick to the last and every value lies on it."""
    if hi <= lo:  # one value: a small range around it
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    step = tick_step(lo, hi, count)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [k * step for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten covering [lo, hi] (lo > 0), at most ~9 of them: every k-th power when
    there are many (a divergence's gradient norm spans 40 decades: labels one above the
    other would overlap)."""
    a, b = (
        math.floor(math.log10(lo)),
        max(math.ceil(math.log10(hi)), math.floor(math.log10(lo)) + 1),
    )
    every = max(1, math.ceil((b - a) / 8))
    b = a + math.ceil((b - a) / every) * every
    return [10.0**k for k in range(a, b + 1, every)]


def decimals_for(ticks: list[float]) -> int:
    """Decimals that tell neighbouring linear ticks apart (0.005 apart: 3; 0.25 apart: 2)."""
    if len(ticks) < 2:
        return 2
    step = abs(ticks[1] - ticks[0])
    power = math.floor(math.log10(step) + 1e-9)
    return max(0, -power + (1 if round(step / 10**power, 6) == 2.5 else 0))


def tick_label(v: float, decimals: int) -> str:
    """A tick as the axis writes it: fixed decimals, or an exponent outside 0.001..100,000."""
    if v != 0 and not 1e-3 <= abs(v) < 1e5:
        return f"{v:.3g}"
    text = f"{v:.{decimals}f}"
    return "0" if float(text) == 0 else text


def step_axis(last_step: float) -> Scale:
    """The step axis of one model's charts: from 0 to a little past the last step anything
    was seen at."""
    last = max(float(last_step), 1.0)
    return Scale(
        0.0, last + max(1.0, 0.015 * last), PAD_L, WIDTH - PAD_R
    )  # a mark at the last step stays clear of the edge


def step_ticks(xs: Scale) -> list[float]:
    lo, hi = xs.domain
    step = max(tick_step(lo, hi, 10), 1.0)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
