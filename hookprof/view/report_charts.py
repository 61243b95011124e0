"""The run report's charts as inline SVG, drawn here: lines over the run, the per-layer
gradient-norm heatmap and the NaN/Inf timeline. All of one model's charts share one step
axis (report_axes.step_axis) and mark the first NaN/Inf at its step.

Every mark carries the number it draws (`data-*` attributes): the page's script shows them
on hover, and the tests check what is drawn against the history it came from."""

from __future__ import annotations

import html
import math
from typing import Any

from hookprof.view.report_axes import (
    PAD_L,
    WIDTH,
    Scale,
    decimals_for,
    linear_ticks,
    log_ticks,
    step_ticks,
    tick_label,
)

HEIGHT = 210  # a line chart's viewBox height
PAD_T, PAD_B = 14, 34
BAD = "#d62728"  # non-finite marks, the incident
HEAT_ROW = 16
HEAT_CELLS = 6000  # cells in one heatmap at most (neighbouring points merged beyond it)
HEAT_LEVELS = 32  # colours in the heatmap's scale: neighbours of one colour are one rect
NAME_CHARS = 26  # a layer name longer than this is cut in the heatmap's margin (hover: whole)


def num(v: float | None, digits: int = 9, unit: str = "") -> str:
    """A value as the page shows it (9 digits: in a data-* attribute): "-" for none, "NaN/Inf"
    for a non-finite one."""
    if v is None:
        return "-"
    if math.isinf(v):
        return "NaN/Inf"
    return f"{v:.{digits}g}{unit}"


def step_label(s: float) -> str:
    return f"{s:,.0f}"


def svg_open(cls: str, height: float, xs: Scale, extra: str = "") -> str:
    """An SVG that scales to the page's width; its step axis (s0..s1 at x0..x1 in the
    viewBox) is in its data-* for the hover script."""
    s0, s1 = xs.domain
    return (
        f'<svg class="{cls}" viewBox="0 0 {WIDTH} {height:.0f}" data-s0="{s0:g}" data-s1="{s1:g}" '
        f'data-x0="{xs.a:g}" data-x1="{xs.b:g}" role="img" {extra}>'
    )


def step_axis_marks(xs: Scale, y: float, top: float) -> str:
    """The x axis at height y: a line, ticks labelled with step numbers, light grid lines up
    to `top`, and the axis title."""
    parts = [f'<line class="axis" x1="{xs.a:g}" y1="{y:g}" x2="{xs.b:g}" y2="{y:g}"/>']
    for s in step_ticks(xs):
        x = xs(s)
        parts.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top:g}" y2="{y:g}"/>'
            f'<text class="xtick" data-step="{s:g}" x="{x:.1f}" y="{y + 15:g}" '
            f'text-anchor="middle">{step_label(s)}</text>'
        )
    parts.append(
        f'<text class="axis-title" x="{xs.b:g}" y="{y + 29:g}" text-anchor="end">training step</text>'
    )
    return "".join(parts)


def incident_mark(
    xs: Scale, step: int | None, top: float, bottom: float, label: bool = True
) -> str:
    """The first NaN/Inf's step across a chart, named at the top."""
    if step is None:
        return ""
    x = xs(step)
    right = x > xs.b - 140  # near the axis' end the label goes to the line's left
    text = (
        (
            f'<text class="incident-label" x="{x - 5 if right else x + 5:.1f}" y="{top + 20:g}" '
            f'text-anchor="{"end" if right else "start"}" fill="{BAD}">NaN/Inf, step {step_label(step)}</text>'
        )
        if label
        else ""
    )
    return (
        f'<line class="incident" data-step="{step}" x1="{x:.1f}" x2="{x:.1f}" y1="{top:g}" '
        f'y2="{bottom:g}" stroke="{BAD}" stroke-width="2" stroke-dasharray="6 3"/>' + text
    )


def line_chart(
    kind: str,
    title: str,
    unit: str,
    xs: Scale,
    steps: list[float],
    spans: list[float],
    values: list[float | None],
    incident: int | None,
    log_allowed: bool = False,
) -> str:
    """Values over steps: a line through the finite ones (broken where a value is missing
    or not finite), a red band over the steps of a non-finite one, the incident's step.
    `spans[i]` is the first step point i covers. Drawn on a log axis when `log_allowed`
    and the values span more than 1000x."""
    if not any(v is not None for v in values):
        head = f'<div class="chart-box"><h3>{html.escape(title)}</h3>'
        return head + '<p class="muted">no values yet</p></div>'
    finite = [v for v in values if v is not None and math.isfinite(v)]
    ys, frame = chart_frame(kind, title, unit, xs, finite, log_allowed)
    bottom = HEIGHT - PAD_B
    out = [frame]
    segments: list[list[str]] = [[]]
    for s, first, v in zip(steps, spans, values):
        if v is None or math.isinf(v):
            if segments[-1]:
                segments.append([])
            if v is not None:  # over the steps the point covers, none before the first NaN
                x0, x1 = xs(_from(first, incident)), xs(s)
                out.append(
                    f'<rect class="nonfinite" data-step="{s:g}" x="{x0:.1f}" y="{PAD_T}" '
                    f'width="{max(x1 - x0, 2):.1f}" height="{bottom - PAD_T:g}" fill="{BAD}" '
                    f'fill-opacity="0.16"/><rect class="nonfinite-top" x="{x0:.1f}" y="{PAD_T}" '
                    f'width="{max(x1 - x0, 2):.1f}" height="5" fill="{BAD}"/>'
                )
            continue
        segments[-1].append(f"{xs(s):.1f},{ys(v):.1f}")
    out.append(line_marks(xs, segments, steps, spans, [num(v) for v in values], incident))
    return "".join(out) + "</div>"


def chart_frame(
    kind: str, title: str, unit: str, xs: Scale, finite: list[float], log_allowed: bool
) -> tuple[Scale, str]:
    """A line chart's heading, its opened SVG, y grid and ticks over the `finite` values (a
    log axis when `log_allowed` and they span more than 1000x) and both axes; and its y
    scale."""
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    log = log_allowed and lo > 0 and hi / lo > 1e3
    ticks = log_ticks(lo, hi) if log else linear_ticks(lo, hi)
    ys = Scale(ticks[0], ticks[-1], HEIGHT - PAD_B, PAD_T, log=log)
    bottom = HEIGHT - PAD_B
    out = [
        f'<div class="chart-box"><h3>{html.escape(title)}</h3>',
        svg_open(
            "chart",
            HEIGHT,
            xs,
            f'data-kind="{kind}" data-log="{int(log)}" data-unit="{html.escape(unit)}"',
        ),
    ]
    decimals = decimals_for(ticks)
    for t in ticks:
        y = ys(t)
        out.append(
            f'<line class="grid" x1="{xs.a:g}" x2="{xs.b:g}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="ytick" data-value="{t:.9g}" x="{xs.a - 6:g}" y="{y + 4:.1f}" '
            f'text-anchor="end">{tick_label(t, decimals)}</text>'
        )
    out.append(step_axis_marks(xs, bottom, PAD_T))
    out.append(f'<line class="axis" x1="{xs.a:g}" y1="{PAD_T}" x2="{xs.a:g}" y2="{bottom:g}"/>')
    return ys, "".join(out)


def line_marks(
    xs: Scale,
    segments: list[list[str]],
    steps: list[float],
    firsts: list[float],
    values: list[str],
    incident: int | None,
) -> str:
    """A chart's line through `segments` (its pieces of "x,y" points), carrying every
    point's steps and value (as the hover shows them), a dot for a point alone between two
    gaps, the incident's mark, the hover's crosshair; closes the SVG."""
    bottom = HEIGHT - PAD_B
    d = " ".join("M" + " L".join(seg) for seg in segments if len(seg) > 1)
    out = [
        f'<path class="line" data-steps="{" ".join(f"{s:g}" for s in steps)}" '
        f'data-first="{" ".join(f"{s:g}" for s in firsts)}" '
        f'data-values="{" ".join(values)}" d="{d}"/>'
    ]
    for seg in segments:
        if len(seg) == 1:
            cx, cy = seg[0].split(",")
            out.append(f'<circle class="dot" cx="{cx}" cy="{cy}" r="2.5"/>')
    out.append(incident_mark(xs, incident, PAD_T, bottom))
    out.append(
        f'<line class="cross" x1="0" x2="0" y1="{PAD_T}" y2="{bottom:g}" display="none"/></svg>'
    )
    return "".join(out)


def _from(first: float, incident: int | None) -> float:
    """Where a non-finite point's mark starts: step k is drawn over (k - 1, k], a point over
    the steps it covers, but none before the run's first NaN, whose step is exact."""
    return first - 1 if incident is None else max(first - 1, incident - 1)


def point_spans(steps: list[float], covered: list[float | None]) -> list[float]:
    """The first step each point covers: the step after the previous point's (the first
    point: its step less the steps it covers, plus one)."""
    spans = []
    for i, s in enumerate(steps):
        if i:
            spans.append(steps[i - 1] + 1)
        else:
            spans.append(max(s - (covered[0] or 1) + 1, 1) if covered else s)
    return spans


# ---------------- the heatmap ----------------


def viridis(t: float) -> str:
    """A few stops of matplotlib's viridis, interpolated: dark = small, yellow = large."""
    stops = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = stops[i], stops[i + 1]
    return "#" + "".join(f"{round(a[c] + (b[c] - a[c]) * f):02x}" for c in range(3))


def _groups(n: int, rows: int) -> list[range]:
    """Neighbouring points merged into columns so that the map has at most HEAT_CELLS cells."""
    width = max(1, min(n, max(48, HEAT_CELLS // max(rows, 1))))
    return [range(j * n // width, (j + 1) * n // width) for j in range(width)]


def _has_norm(row: dict[str, Any]) -> bool:
    return any(v is not None for v in row["grad_norm"])


def heat_rows(layers: list[dict[str, Any]]) -> int:
    """How many rows the heat map draws: the tracked layers with a gradient norm (a layer
    without parameters has none), what its heading counts (issue 41: "8 tracked layers"
    above 7 rows)."""
    return sum(map(_has_norm, layers))


def _group_max(values: list[float | None], group: range) -> float | None:
    present: list[float] = [v for j in group if (v := values[j]) is not None]
    return max(present) if present else None  # inf (non-finite) wins


def heatmap(
    xs: Scale,
    steps: list[float],
    spans: list[float],
    layers: list[dict[str, Any]],
    incident: int | None,
    hatch_id: str,
) -> str:
    """Gradient norm per layer over the run: one row per tracked layer, each cell over the
    steps its points cover, colour by log10 of the norm over the whole map's range (one of
    HEAT_LEVELS colours); red where it was not finite, hatched where there was no value."""
    rows = [r for r in layers if _has_norm(r)]
    if not rows or not steps:
        return '<p class="muted">no gradient norms yet</p>'
    groups = _groups(len(steps), len(rows))
    binned = [(r["name"], [_group_max(r["grad_norm"], g) for g in groups]) for r in rows]
    finite = [v for _, vals in binned for v in vals if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(finite)), math.log10(max(finite))) if finite else (0.0, 1.0)
    span = hi - lo or 1.0

    def colour(v: float | None) -> str:
        if v is None:
            return f"url(#{hatch_id})"
        if math.isinf(v):
            return BAD
        t = (math.log10(v) - lo) / span if v > 0 else 0.0
        return viridis(round(t * (HEAT_LEVELS - 1)) / (HEAT_LEVELS - 1))

    top = 8
    bottom = top + HEAT_ROW * len(binned)
    height = bottom + 40
    out = [
        svg_open("heatmap", height, xs, f'data-lo="{10**lo:.6g}" data-hi="{10**hi:.6g}"'),
        f'<defs><pattern id="{hatch_id}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="#bbb" stroke-width="2"/></pattern></defs>',
        step_axis_marks(xs, bottom + 2, top),
    ]  # first: its grid lines under the cells
    for k, (name, vals) in enumerate(binned):
        y = top + k * HEAT_ROW
        short = name if len(name) <= NAME_CHARS else "..." + name[-(NAME_CHARS - 3) :]
        out.append(
            f'<g class="row" data-layer="{html.escape(name)}"><text x="{xs.a - 6:g}" y="{y + 12}" '
            f'text-anchor="end"><title>{html.escape(name)}</title>{html.escape(short)}</text>'
        )
        j = 0
        while j < len(groups):  # a run of neighbouring cells of one colour is one rect
            fill, end, peak = colour(vals[j]), j, vals[j]
            while end + 1 < len(groups) and colour(vals[end + 1]) == fill:
                end += 1
                value = vals[end]
                if value is not None and (peak is None or value > peak):
                    peak = value
            first, last = spans[groups[j][0]], steps[groups[end][-1]]
            x0 = xs(_from(first, incident) if fill == BAD else first - 1)
            x1 = xs(last)
            # 0.5 more than the width: no hairline between neighbours when the page scales
            out.append(
                f'<rect data-v="{num(peak, 6)}" data-s="{first:g}-{last:g}" x="{x0:.1f}" y="{y}" '
                f'width="{max(x1 - x0, 0.5) + 0.5:.1f}" height="{HEAT_ROW - 2}" fill="{fill}"/>'
            )
            j = end + 1
        out.append("</g>")
    out.append(incident_mark(xs, incident, 0, bottom + 2, label=False))
    out.append(f'<line class="cross" x1="0" x2="0" y1="{top}" y2="{bottom}" display="none"/></svg>')
    return "".join(out) + _heat_legend(lo, hi, hatch_id)


def _heat_legend(lo: float, hi: float, hatch_id: str) -> str:
    """The colour scale, its ends labelled with norms, and what red and hatched mean."""
    stops = "".join(f'<stop offset="{k / 8:.3f}" stop-color="{viridis(k / 8)}"/>' for k in range(9))
    return (
        f'<svg class="legend-scale" viewBox="0 0 {WIDTH} 34" role="img">'
        f'<defs><linearGradient id="{hatch_id}-scale">{stops}</linearGradient></defs>'
        f'<text x="{PAD_L - 6}" y="17" text-anchor="end">gradient norm</text>'
        f'<text class="scale-lo" x="{PAD_L}" y="17" data-value="{10**lo:.6g}">{10**lo:.3g}</text>'
        f'<rect x="{PAD_L + 50}" y="6" width="240" height="14" fill="url(#{hatch_id}-scale)"/>'
        f'<text class="scale-hi" x="{PAD_L + 296}" y="17" data-value="{10**hi:.6g}">{10**hi:.3g} (log scale)</text>'
        f'<rect x="{PAD_L + 430}" y="6" width="14" height="14" fill="{BAD}"/>'
        f'<text x="{PAD_L + 450}" y="17">NaN/Inf</text>'
        f'<rect x="{PAD_L + 520}" y="6" width="14" height="14" fill="url(#{hatch_id})" stroke="#bbb"/>'
        f'<text x="{PAD_L + 540}" y="17">no value (no gradient, or the layer was not tracked yet)</text></svg>'
    )


# ---------------- the NaN/Inf timeline ----------------


def dropped_gaps(events: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """Where the history dropped events: between two kept events whose counts do not follow
    on (the later one's count before it is above the earlier one's count after it). Each as
    (after step, before step, at most how many non-finite steps in between). The counts add
    up the phases (a step bad in forward, backward and loss counts three), so the steps lost
    are at most that sum and at most the steps between the two (issue 41: "4,412 events not
    kept (13,236 non-finite steps)" in a run of 4,775 steps)."""
    gaps = []
    for a, b in zip(events, events[1:]):
        missing = b["nonfinite_steps"] - b["new_nonfinite_steps"] - a["nonfinite_steps"]
        if missing > 0:
            gaps.append((a["step"], b["step"], min(missing, b["step"] - a["step"] - 1)))
    return gaps


def timeline(
    xs: Scale, events: list[dict[str, Any]], dropped: int, incident: int | None, hatch_id: str
) -> str:
    """Each time new non-finite steps were seen (a red dot, hover for the layers), the
    first incident, and the stretches whose events the history did not keep, hatched and
    labelled: a plain line there would read as steps without NaN."""
    height = 74
    y = 30
    out = [
        svg_open("timeline", height, xs),
        f'<defs><pattern id="{hatch_id}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fbe9e9"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{BAD}" stroke-opacity="0.45" stroke-width="2"/></pattern></defs>',
        step_axis_marks(xs, height - 34, 6),
    ]
    gaps = dropped_gaps(events)
    for after, before, missing in gaps:
        x0, x1 = xs(after), xs(before)
        out.append(
            f'<rect class="dropped" data-from="{after}" data-to="{before}" data-steps="{missing}" '
            f'data-events="{dropped}" x="{x0:.1f}" y="{y - 12}" width="{max(x1 - x0, 2):.1f}" height="24" '
            f'fill="url(#{hatch_id})" data-tip="{dropped:,} events not kept between steps {after:,} and '
            f'{before:,}: up to {missing:,} more non-finite steps there"/>'
            f'<text class="dropped-label" x="{(x0 + x1) / 2:.1f}" y="{y - 15}" text-anchor="middle" '
            f'fill="{BAD}">{dropped:,} events not kept (up to {missing:,} non-finite steps)</text>'
        )
    for e in events:
        names = ", ".join(e["layers"]) + (f" +{e['more_layers']}" if e["more_layers"] else "")
        tip = (
            f"step {e['step']:,}: {e['new_nonfinite_steps']} new non-finite phase count(s), "
            f"{e['nonfinite_steps']} so far (a step bad in forward, backward and loss counts 3); "
            + (names or "no layer named")
        )
        out.append(
            f'<circle class="event" data-step="{e["step"]}" data-new="{e["new_nonfinite_steps"]}" '
            f'cx="{xs(e["step"]):.1f}" cy="{y}" r="4" fill="{BAD}" data-tip="{html.escape(tip)}"/>'
        )
    out.append(incident_mark(xs, incident, 4, height - 34, label=False))
    out.append("</svg>")
    return "".join(out)
