"""The report's every-step charts (issue 41): a run's loss and global gradient norm step by
step (publish/every_step.py), not only at its sampled steps.

What a person needs from them is the lead-up to an incident and what is still informative
after it, so:
- the steps kept at full resolution (the latest ones, and those around the first NaN/Inf)
  are a line; older steps are bands from their minimum to their maximum with their mean;
- the y axis is scaled to the finite values only, and a non-finite value is a red tick on
  the top edge (one per step, or per band with the count), not a fill over the plot: after
  a divergence the finite values around it stay readable;
- under the chart, in words: the window at full resolution, the bands' width, and how many
  of the drawn steps were non-finite, with the run's non-finite steps per phase.

Every mark carries what it draws (`data-*`), as the other charts' do."""

from __future__ import annotations

import math
from typing import Any

from hookprof.view.report_axes import Scale
from hookprof.view.report_charts import BAD, PAD_T, chart_frame, line_marks, num

BAND_FILL = "#1f77b4"


def has_values(every: dict[str, Any] | None, col: str) -> bool:
    """Whether the document's every-step series holds any value of `col`."""
    if not every:
        return False
    return any(v is not None for v in every["full"][col]) or any(
        n for n in every["bands"][f"{col}_n"] + every["bands"][f"{col}_bad"] if n
    )


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def step_chart(
    kind: str,
    title: str,
    xs: Scale,
    every: dict[str, Any],
    col: str,
    incident: int | None,
    nonfinite_by_phase: dict[str, int],
    log_allowed: bool = False,
    unit: str = "",
    scale: float = 1.0,
) -> str:
    """One column (`loss`, `grad_norm`, `step_seconds`) of the every-step series over the
    run, its values times `scale` (seconds drawn as ms: 1e3), in `unit`."""

    def scaled(values: list[Any]) -> list[Any]:
        return values if scale == 1.0 else [v if v is None else v * scale for v in values]

    full, bands = every["full"], every["bands"]
    steps, values = full["step"], scaled(full[col])
    firsts, lasts = bands["first"], bands["last"]
    lows, highs = scaled(bands[f"{col}_min"]), scaled(bands[f"{col}_max"])
    means = scaled(bands[f"{col}_mean"])
    band_bad = bands[f"{col}_bad"]
    finite = [v for v in values if _finite(v)] + [v for v in lows + highs if _finite(v)]
    ys, frame = chart_frame(kind, title, unit, xs, finite, log_allowed)
    out = [frame]

    # the bands: min to max, a mean line through them (hover: mean~min~max)
    hover_steps: list[float] = []
    hover_first: list[float] = []
    hover_values: list[str] = []
    mean_points: list[list[str]] = [[]]
    for first, last, low, high, mean, bad in zip(firsts, lasts, lows, highs, means, band_bad):
        x0, x1 = xs(first - 1), xs(last)
        if _finite(low) and _finite(high):
            y0, y1 = ys(high), ys(low)
            out.append(
                f'<rect class="band" data-first="{first:g}" data-last="{last:g}" '
                f'data-min="{num(low)}" data-max="{num(high)}" data-mean="{num(mean)}" '
                f'x="{x0:.1f}" y="{y0:.1f}" width="{max(x1 - x0, 1):.1f}" '
                f'height="{max(y1 - y0, 1):.1f}" fill="{BAND_FILL}" fill-opacity="0.18"/>'
            )
            mean_points[-1].append(f"{xs(last):.1f},{ys(mean):.1f}")
            hover_values.append(f"{num(mean)}~{num(low)}~{num(high)}")
        else:
            if mean_points[-1]:
                mean_points.append([])
            hover_values.append("NaN/Inf" if bad else "-")
        hover_steps.append(last)
        hover_first.append(first)
        if bad:
            out.append(_tick(xs, first - 1, last, f'data-first="{first:g}" data-count="{bad:g}"'))
    # the steps at full resolution: a line broken where a value is missing or not finite
    banded = lasts[-1] if lasts else 0
    segments: list[list[str]] = [[]]
    for s, v in zip(steps, values):
        hover_steps.append(s)
        hover_first.append(s)
        hover_values.append(num(v))
        if not _finite(v):
            if segments[-1]:
                segments.append([])
            if v is not None and s > banded:  # (a band's tick counts the lead-up's)
                out.append(_tick(xs, s - 1, s, f'data-step="{s:g}"'))
            continue
        segments[-1].append(f"{xs(s):.1f},{ys(v):.1f}")
    if any(len(p) > 1 for p in mean_points):
        d = " ".join("M" + " L".join(p) for p in mean_points if len(p) > 1)
        out.append(f'<path class="band-mean" d="{d}"/>')
    order = sorted(range(len(hover_steps)), key=hover_steps.__getitem__)
    out.append(
        line_marks(
            xs,
            segments,
            [hover_steps[i] for i in order],
            [hover_first[i] for i in order],
            [hover_values[i] for i in order],
            incident,
        )
    )
    out.append(_caption(every, col, nonfinite_by_phase))
    return "".join(out) + "</div>"


def _tick(xs: Scale, s0: float, s1: float, data: str) -> str:
    x0, x1 = xs(s0), xs(s1)
    return (
        f'<rect class="nonfinite-tick" {data} x="{x0:.1f}" y="{PAD_T - 8:g}" '
        f'width="{max(x1 - x0, 2):.1f}" height="6" fill="{BAD}"/>'
    )


def _span(steps: list[float]) -> str:
    return f"{int(steps[0]):,}-{int(steps[-1]):,}" if steps else "none"


def _caption(every: dict[str, Any], col: str, by_phase: dict[str, int]) -> str:
    """The chart's window in words, and what the red ticks count."""
    full, bands = every["full"], every["bands"]
    steps = full["step"]
    parts = []
    runs: list[list[float]] = []
    for s in steps:  # the full-resolution runs: the lead-up and the latest steps
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    if runs:
        parts.append("each step of " + " and of ".join(_span(r) for r in runs))
    if bands["first"]:
        parts.append(
            f"steps {int(bands['first'][0]):,}-{int(bands['last'][-1]):,} in bands of up to "
            f"{every['stride']:,} steps (minimum to maximum, line: mean)"
        )
    banded = bands["last"][-1] if bands["last"] else 0  # (the lead-up is in the bands too)
    bad_full = sum(
        1 for s, v in zip(steps, full[col]) if s > banded and v is not None and math.isinf(v)
    )
    bad = bad_full + int(sum(bands[f"{col}_bad"]))
    text = "Drawn: " + "; ".join(parts) + "."
    if bad:
        phases = ", ".join(f"{p} {n:,}" for p, n in by_phase.items() if n)
        text += (
            f' <span class="bad">{bad:,} of these steps had a non-finite value</span> (red '
            f"ticks on the top edge; the axis is scaled to the finite ones)."
            + (f" Non-finite steps by phase over the run: {phases}." if phases else "")
        )
    return f'<p class="muted chart-note">{text}</p>'
