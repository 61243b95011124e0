"""The run report as one self-contained HTML page: inline SVG drawn here, inline CSS, no
script, nothing fetched when it is viewed (it opens from a file, offline, anywhere).

Every mark carries the number it draws (`data-*` attributes), so what a chart shows can be
checked against the history it came from, and a reader can hover for exact values."""

from __future__ import annotations

import html
import math
import time
from typing import Any

from hookprof.files import write_atomic

WIDTH, HEIGHT = 440, 170  # one line chart: two side by side in a 1000-pixel window
PAD_L, PAD_R, PAD_T, PAD_B = 58, 12, 10, 26
BAR_LAYERS = 25  # the busiest layers drawn as bars
HEAT_COLUMNS = 96  # points per heatmap row, merged (maximum) beyond that
BAD = "#d62728"  # non-finite marks

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 6px}h3{font-size:14px;margin:10px 0 2px}
.muted{color:#666}.bad{color:#d62728;font-weight:600}.grid{display:flex;flex-wrap:wrap;gap:18px}
table.kv td{padding:1px 12px 1px 0}svg text{font-size:11px;fill:#444}svg .axis{stroke:#999}
svg .line{fill:none;stroke:#1f77b4;stroke-width:1.5}.legend span{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}
.model{border-top:1px solid #ddd;margin-top:24px}
"""


def _num(v: float | None, unit: str = "", digits: int = 4) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "NaN/Inf"
    return f"{v:.{digits}g}{unit}"


def _data(v: float | None) -> str:
    """A value in a data-* attribute: enough digits to check the drawing against."""
    return _num(v, digits=9)


def _tick(v: float) -> str:
    """An axis label short enough for the margin: 3 significant digits, no exponent between
    0.001 and 100,000."""
    if v == 0 or not 1e-3 <= abs(v) < 1e5:
        return f"{v:.3g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f}"


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


class Scale:
    """Linear (or log10) map from data to pixels."""

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

    def value(self, t: float) -> float:
        """The data value at fraction t of the axis."""
        v = self.lo + t * (self.hi - self.lo)
        return 10 ** v if self.log else v


def line_chart(kind: str, title: str, steps: list[float], values: list[float | None]) -> str:
    """Values over steps: a line through the finite ones, a red mark at the top for each
    non-finite one. Gradient norms go on a log axis when they span more than 1000x."""
    finite = _finite(values)
    head = f'<div><h3>{html.escape(title)}</h3>'
    if not finite and not any(v is not None for v in values):
        return head + '<p class="muted">no values yet</p></div>'
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    log = lo > 0 and hi / lo > 1e3
    xs = Scale(min(steps), max(steps), PAD_L, WIDTH - PAD_R)
    ys = Scale(lo, hi, HEIGHT - PAD_B, PAD_T, log=log)
    pts, bad = [], []
    for s, v in zip(steps, values):
        if v is None:
            continue
        if math.isinf(v):
            bad.append(f'<line class="nonfinite" data-step="{s:g}" x1="{xs(s):.1f}" x2="{xs(s):.1f}" '
                       f'y1="{PAD_T}" y2="{HEIGHT - PAD_B}" stroke="{BAD}" stroke-width="1.5"/>')
        else:
            pts.append(f"{xs(s):.1f},{ys(v):.1f}")
    out = [head, f'<svg class="chart" data-kind="{kind}" data-log="{int(log)}" width="{WIDTH}" '
                 f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">',
           _axes(xs, ys),
           f'<polyline class="line" data-steps="{" ".join(f"{s:g}" for s in steps)}" '
           f'data-values="{" ".join(_data(v) for v in values)}" points="{" ".join(pts)}"/>',
           *bad, "</svg></div>"]
    return "".join(out)


def _axes(xs: Scale, ys: Scale) -> str:
    y0, x0 = HEIGHT - PAD_B, PAD_L
    parts = [f'<line class="axis" x1="{x0}" y1="{y0}" x2="{WIDTH - PAD_R}" y2="{y0}"/>',
             f'<line class="axis" x1="{x0}" y1="{PAD_T}" x2="{x0}" y2="{y0}"/>']
    for t in (0.0, 0.5, 1.0):
        v = ys.value(t)
        y = ys.a + t * (ys.b - ys.a)
        parts.append(f'<text class="ytick" data-value="{v:.9g}" x="{x0 - 4}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{_tick(v)}</text>')
        s = xs.value(t)
        x = xs.a + t * (xs.b - xs.a)
        parts.append(f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle">{s:.0f}</text>')
    return "".join(parts)


def layer_bars(layers: list[dict[str, Any]], total: int) -> str:
    """Mean forward and backward milliseconds per sampled step, the busiest layers first."""
    ranked = sorted(layers, key=lambda r: r["forward_seconds"] + r["backward_seconds"], reverse=True)[:BAR_LAYERS]
    if not ranked:
        return '<p class="muted">no sampled step yet</p>'
    longest = max(r["forward_seconds"] + r["backward_seconds"] for r in ranked) or 1.0
    label_w, bar_w, row = 190, 330, 16
    h = row * len(ranked) + 8
    out = [f'<svg class="bars" width="{label_w + bar_w + 90}" height="{h}" role="img">']
    for k, r in enumerate(ranked):
        y = 4 + k * row
        f_ms, b_ms = r["forward_seconds"] * 1e3, r["backward_seconds"] * 1e3
        fw = r["forward_seconds"] / longest * bar_w
        bw = r["backward_seconds"] / longest * bar_w
        bad = any(r["nonfinite"].values())
        name = html.escape(r["name"])
        out.append(f'<text x="{label_w - 6}" y="{y + 11}" text-anchor="end"'
                   f'{" class=" + chr(34) + "bad" + chr(34) if bad else ""}>{name}</text>')
        out.append(f'<rect class="fwd" data-layer="{name}" data-ms="{f_ms:.6g}" x="{label_w}" y="{y}" '
                   f'width="{fw:.2f}" height="{row - 4}" fill="#1f77b4"><title>{name} forward {f_ms:.3g} ms</title></rect>')
        out.append(f'<rect class="bwd" data-layer="{name}" data-ms="{b_ms:.6g}" x="{label_w + fw:.2f}" y="{y}" '
                   f'width="{bw:.2f}" height="{row - 4}" fill="#ff7f0e"><title>{name} backward {b_ms:.3g} ms</title></rect>')
        out.append(f'<text x="{label_w + fw + bw + 4:.1f}" y="{y + 11}">{f_ms + b_ms:.3g} ms</text>')
    out.append("</svg>")
    more = f'<p class="muted">{total - len(ranked)} more layers not drawn</p>' if total > len(ranked) else ""
    return ('<p class="legend"><span style="background:#1f77b4"></span>forward'
            '<span style="background:#ff7f0e"></span>backward (mean per sampled step)</p>'
            + "".join(out) + more)


def _bin_max(values: list[float | None], groups: list[range]) -> list[float | None]:
    out: list[float | None] = []
    for g in groups:
        present = [values[j] for j in g if values[j] is not None]
        out.append(max(present) if present else None)  # inf (non-finite) wins
    return out


def heatmap(steps: list[float], layers: list[dict[str, Any]]) -> str:
    """Gradient norm per layer over the run: one row per tracked layer, colour by log10 of
    the norm over the whole map's range; red where it was not finite, grey where none."""
    rows = [r for r in layers if any(v is not None for v in r["grad_norm"])]
    if not rows or not steps:
        return '<p class="muted">no gradient norms yet</p>'
    n = len(steps)
    width = min(n, HEAT_COLUMNS)
    groups = [range(j * n // width, (j + 1) * n // width) for j in range(width)]
    binned = [(r["name"], _bin_max(r["grad_norm"], groups)) for r in rows]
    finite = [v for _, vals in binned for v in vals if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(finite)), math.log10(max(finite))) if finite else (0.0, 1.0)
    span = hi - lo or 1.0
    label_w, cell_w, cell_h = 190, max(3, 420 // width), 12
    out = [f'<svg class="heatmap" data-steps="{" ".join(f"{steps[g[-1]]:g}" for g in groups)}" '
           f'data-lo="{lo:.6g}" data-hi="{hi:.6g}" width="{label_w + cell_w * width + 10}" '
           f'height="{cell_h * len(binned) + 22}" role="img">']
    for k, (name, vals) in enumerate(binned):
        y = k * cell_h
        out.append(f'<g class="row" data-layer="{html.escape(name)}"><text x="{label_w - 6}" y="{y + 10}" '
                   f'text-anchor="end">{html.escape(name)}</text>')
        for j, v in enumerate(vals):
            if v is None:
                fill = "#eee"
            elif math.isinf(v):
                fill = BAD
            else:
                t = (math.log10(v) - lo) / span if v > 0 else 0.0
                fill = _viridis(t)
            out.append(f'<rect data-v="{_data(v)}" x="{label_w + j * cell_w}" y="{y}" width="{cell_w}" '
                       f'height="{cell_h - 1}" fill="{fill}"/>')
        out.append("</g>")
    y = cell_h * len(binned) + 14
    out.append(f'<text x="{label_w}" y="{y}">{10 ** lo:.2g}</text>'
               f'<text x="{label_w + cell_w * width}" y="{y}" text-anchor="end">{10 ** hi:.2g}</text></svg>')
    return "".join(out)


def _viridis(t: float) -> str:
    """A few stops of matplotlib's viridis, interpolated: dark = small, yellow = large."""
    stops = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = stops[i], stops[i + 1]
    return "#%02x%02x%02x" % tuple(round(a[c] + (b[c] - a[c]) * f) for c in range(3))


def nan_timeline(doc: dict[str, Any], steps: list[float]) -> str:
    first = doc["first_nonfinite"]
    events = doc["history"]["events"]
    counts = doc["nonfinite_steps"]
    if first is None and not events:
        return '<p>No NaN or Inf in any step so far (loss, forward and backward checked).</p>'
    last_step = max([doc["steps"], *steps, *(e["step"] for e in events)] or [1])
    xs = Scale(0, max(last_step, 1), PAD_L, WIDTH - PAD_R)
    out = []
    if first is not None:
        out.append(f'<p class="bad first-offender" data-layer="{html.escape(str(first["layer"]))}" '
                   f'data-step="{first["step"]}" data-phase="{first["phase"]}">'
                   f'{html.escape(first["summary"])}</p>')
    out.append('<p>Non-finite steps: ' + ", ".join(f"{p} {c}" for p, c in counts.items()) + "</p>")
    out.append(f'<svg class="timeline" width="{WIDTH}" height="60" role="img">'
               f'<line class="axis" x1="{PAD_L}" y1="30" x2="{WIDTH - PAD_R}" y2="30"/>'
               f'<text x="{PAD_L}" y="52">0</text><text x="{WIDTH - PAD_R}" y="52" text-anchor="end">'
               f'step {last_step:.0f}</text>')
    if first is not None:
        x = xs(first["step"])
        out.append(f'<line class="first" data-step="{first["step"]}" x1="{x:.1f}" x2="{x:.1f}" y1="8" '
                   f'y2="40" stroke="{BAD}" stroke-width="3"/>')
    for e in events:
        x = xs(e["step"])
        names = ", ".join(e["layers"]) + (f" +{e['more_layers']}" if e["more_layers"] else "")
        out.append(f'<circle class="event" data-step="{e["step"]}" data-new="{e["new_nonfinite_steps"]}" '
                   f'cx="{x:.1f}" cy="30" r="4" fill="{BAD}"><title>seen at step {e["step"]}: '
                   f'{e["new_nonfinite_steps"]} new non-finite step(s); {html.escape(names or "no layer")}'
                   f'</title></circle>')
    out.append("</svg>")
    if doc["history"]["events_dropped"]:
        out.append(f'<p class="muted">{doc["history"]["events_dropped"]} events in the middle not kept</p>')
    return "".join(out)


def model_section(doc: dict[str, Any]) -> str:
    hist = doc["history"]
    pts = hist["points"]
    steps = pts["step"]
    summary = [("steps", doc["steps"]), ("sampled steps", doc["sampled_steps"]),
               ("mean step time", _num(doc["step_seconds_mean"] and doc["step_seconds_mean"] * 1e3, " ms")),
               ("loss (last sampled)", _num(doc["loss"])), ("gradient norm (last sampled)", _num(doc["grad_norm"])),
               ("history", f"{len(steps)} points, {hist['stride']} sampled step(s) per point")]
    rows = "".join(f"<tr><td class=muted>{k}</td><td>{v}</td></tr>" for k, v in summary)
    ms = [None if v is None else (v if math.isinf(v) else v * 1e3) for v in pts["step_seconds"]]
    return "".join([
        f'<section class="model" data-model="{html.escape(doc["model"])}">',
        f'<h1>{html.escape(doc["model"])} <span class="muted">rank {doc["rank"]}</span></h1>',
        f'<table class="kv">{rows}</table>',
        "<h2>NaN/Inf timeline</h2>", nan_timeline(doc, steps),
        "<h2>Over the run</h2><div class=grid>",
        line_chart("step_seconds", "Step time (ms, mean over the steps a point covers)", steps, ms),
        line_chart("loss", "Loss", steps, pts["loss"]),
        line_chart("grad_norm", "Global gradient norm (maximum over a point)", steps, pts["grad_norm"]),
        "</div>",
        f'<h2>Per-layer time <span class="muted">({len(doc["layer_totals"])} of {doc["layers_total"]} layers exported)</span></h2>',
        layer_bars(doc["layer_totals"], len(doc["layer_totals"])),
        "<h2>Gradient norm per layer over the run</h2>", heatmap(steps, hist["layers"]),
        "</section>",
    ])


def render(documents: list[dict[str, Any]], source: str = "") -> str:
    """The whole page for one or more models' documents (report.document / report.fetch)."""
    made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    title = "hookprof report: " + ", ".join(d["model"] for d in documents)
    body = "".join(model_section(d) for d in documents) or "<p>No model is attached there.</p>"
    where = f" from {html.escape(source)}" if source else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width"><style>{CSS}</style></head><body>'
            f'<p class="muted">hookprof run report{where}, made {made}</p>{body}</body></html>')


def write(path: str, documents: list[dict[str, Any]], source: str = "") -> str:
    """The page for `documents` written to `path`; returns the path. Written whole or not
    at all (files.write_atomic): a failed write leaves the previous report as it was."""
    return write_atomic(path, render(documents, source=source))
