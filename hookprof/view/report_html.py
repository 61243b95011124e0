"""The run report as one self-contained HTML page: inline SVG drawn here (report_charts),
inline CSS and a small inline script for hover values and sorting, nothing fetched when it is
viewed (it opens from a file, offline, anywhere; without the script every figure is still
on the page).

Per model: the figures of the run, the first NaN/Inf in words (how it was found, what its
replay said, its capsule), the NaN/Inf timeline, step time, loss and gradient norm over the
steps, the per-layer gradient norms, and the per-layer table `hookprof top` shows."""

from __future__ import annotations

import html
import math
import time
from typing import Any

from hookprof.files import write_atomic
from hookprof.view.report_axes import step_axis
from hookprof.view.report_charts import heat_rows, heatmap, line_chart, num, point_spans, timeline
from hookprof.view.report_script import CSS, SCRIPT
from hookprof.view.report_steps import has_values, step_chart
from hookprof.view.table import (
    COLUMNS,
    TITLES,
    LayerRow,
    cells,
    choose,
    first_differing_text,
    from_document,
    sort_rows,
)

TABLE_ROWS = 200  # the busiest layers in the table, plus every one that went non-finite

REPLAY_WORDS = {
    "reproducible": "reproducible: the step replayed with the same inputs, weights and RNG made it again "
    "(the data or the model)",
    "transient": "transient: the step replayed with the same inputs, weights and RNG was finite "
    "(suspect a non-deterministic kernel, a race, or the hardware)",
    "not replayed": "not replayed",
}

# a spike's replay verdict in words (Config.spike_replay, integrity/spike_replay.py)
_VERDICT = {
    "reproduced": "its replay reproduced it: the data",
    "not_reproduced": "its replay did not reproduce it: the machine",
    "not_compared": "its step could not be replayed",
}


def last_step(doc: dict[str, Any]) -> float:
    """The last step anything on the page was seen at: the charts' step axis ends there, so
    that an incident after the last sampled step (on_nonfinite="raise") is on every chart."""
    first = doc["first_nonfinite"]
    return max(
        [
            float(doc["steps"]),
            *doc["history"]["points"]["step"],
            *(doc["history"].get("every_step") or {"full": {"step": []}})["full"]["step"][-1:],
            *(e["step"] for e in doc["history"]["events"]),
            *([first["step"]] if first else []),
        ]
    )


def _after(doc: dict[str, Any]) -> str:
    """When the last sampled step came before the first NaN/Inf (few sampled steps in a short
    run, or the incident after the last one): say so next to a value that reads finite."""
    steps, first = doc["history"]["points"]["step"], doc["first_nonfinite"]
    if not steps or first is None or first["step"] <= steps[-1]:
        return ""
    return f" at step {int(steps[-1]):,}; NaN/Inf from step {first['step']:,}"


def _sampled_step_ms(doc: dict[str, Any]) -> float | None:
    """The sampled steps' mean wall time in ms (None from an endpoint that did not keep it)."""
    seconds = doc.get("sampled_step_seconds_sum")
    return seconds / doc["sampled_steps"] * 1e3 if seconds and doc["sampled_steps"] else None


def summary(doc: dict[str, Any]) -> str:
    hist = doc["history"]
    counts = doc["nonfinite_steps"]
    bad = sum(counts.values())
    figures = [
        ("steps", f"{doc['steps']:,}"),
        ("sampled steps", f"{doc['sampled_steps']:,}"),
        (
            f"mean step time, all {doc['steps']:,} steps",
            num(doc["step_seconds_mean"] and doc["step_seconds_mean"] * 1e3, 4, " ms"),
        ),
    ]
    sampled_mean = _sampled_step_ms(doc)
    if sampled_mean is not None:  # the window of the layers' times and shares
        figures.append(
            (
                f"mean sampled step, the layers' {doc['sampled_steps']:,}",
                num(sampled_mean, 4, " ms"),
            )
        )
    figures += [
        ("loss, last sampled", num(doc["loss"], 4) + _after(doc)),
        ("gradient norm, last sampled", num(doc["grad_norm"], 4) + _after(doc)),
        ("non-finite steps", ", ".join(f"{p} {c:,}" for p, c in counts.items()) if bad else "none"),
    ]
    for kind, spike in (doc.get("spikes") or {}).items():
        if spike["count"]:  # (publish/spikes.py: a loss or gradient-norm spike, no NaN)
            first = spike["first"]
            figures.append(
                (
                    f"{kind.replace('_', ' ')}s",
                    f"{spike['count']:,}; first at step {first['step']:,}"
                    + (f" in {first['layer']}" if first.get("layer") else "")
                    + ": "
                    f"{num(first['value'], 4)} against a median of {num(first['median'], 4)} "
                    f"(robust z {num(first['z'], 3)})"
                    + (f"; {_VERDICT[first['verdict']]}" if first.get("verdict") else "")
                    + (
                        f" ({first_differing_text(first['entered'], first.get('entered_phase'))})"
                        if first.get("entered")
                        else ""
                    )
                    + (
                        "; its batch's samples of largest loss: "
                        + ", ".join(
                            f"sample {s['sample']} ({num(s['loss'], 4)})" for s in first["suspects"]
                        )
                        if first.get("suspects")
                        else ""
                    ),
                )
            )
    spike_replays = doc.get("spike_replays") or {}
    if spike_replays:  # (hookprof/integrity/spike_replay.py)
        latest = doc.get("spike_mismatch")
        figures.append(
            (
                "spike replays",
                f"{spike_replays.get('reproduced', 0):,} reproduced (the data), "
                f"{spike_replays.get('not_reproduced', 0):,} not reproduced (the machine)"
                + (
                    f" (latest: step {latest['step']:,}, "
                    f"{first_differing_text(latest['layer'], latest.get('phase'))})"
                    if latest
                    else ""
                )
                + (
                    f", {spike_replays['not_compared']:,} not compared"
                    if spike_replays.get("not_compared")
                    else ""
                ),
            )
        )
    checks = doc.get("replay_checks") or {}
    if checks:  # (hookprof/integrity/replay_check.py)
        mismatch = doc.get("replay_mismatch")
        figures.append(
            (
                "replay checks",
                f"{checks.get('reproduced', 0):,} reproduced, "
                f"{checks.get('not_reproduced', 0):,} not reproduced"
                + (
                    f" (latest: {mismatch['layer']}'s output differed at step "
                    f"{mismatch['step']:,}: the machine, not the data)"
                    if mismatch
                    else ""
                )
                + (
                    f", {checks['not_compared']:,} not compared"
                    if checks.get("not_compared")
                    else ""
                ),
            )
        )
    if doc["skipped_steps"]:
        figures.append(("GradScaler skipped", f"{doc['skipped_steps']:,} steps"))
    if doc.get("held_back_updates"):
        figures.append(("updates held back", f"{doc['held_back_updates']:,}"))
    figures.append(
        ("history", f"{len(hist['points']['step'])} points, {hist['stride']} sampled step(s) each")
    )
    return (
        '<div class="figures">'
        + "".join(
            f'<div class="figure{" bad-box" if k == "non-finite steps" and bad else ""}"><span>{k}</span>'
            f"<b>{html.escape(str(v))}</b></div>"
            for k, v in figures
        )
        + "</div>"
    )


def incident(doc: dict[str, Any]) -> str:
    """The first NaN/Inf in words, with how it was found, the replay's verdict and the
    capsule that holds the bad step (issue 31; absent before it)."""
    first = doc["first_nonfinite"]
    if first is None:
        return '<p class="clean">No NaN or Inf in any step so far (loss, forward and backward checked).</p>'
    rows = [
        (
            "where",
            f"{first['layer'] if first['layer'] is not None else 'no layer named'} "
            f"({first['phase']} phase), step {first['step']:,}",
        )
    ]
    if first.get("found_by"):
        rows.append(("found by", first["found_by"]))
    if first.get("propagators"):
        rows.append(("then flowed through", ", ".join(first["propagators"])))
    replay = first.get("replay")
    if replay:
        words = REPLAY_WORDS.get(replay, replay)
        if first.get("replay_note"):
            words += f" ({first['replay_note']})"
        rows.append(
            (
                "replay",
                f'<span class="verdict" data-replay="{html.escape(replay)}">{html.escape(words)}</span>',
            )
        )
    capsule = first.get("capsule")
    if capsule:
        rows.append(
            (
                "capsule",
                f'<code class="capsule">{html.escape(str(capsule))}</code> '
                f"(reproduce it anywhere: <code>hookprof replay {html.escape(str(capsule))}</code>)",
            )
        )
    if first.get("device") and first["device"] != "cpu":
        rows.append(("device", html.escape(str(first["device"]))))
    body = "".join(
        f"<tr><th>{k}</th><td>{v if k in ('replay', 'capsule') else html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return (
        f'<div class="incident-box"><p class="bad first-offender" data-layer="{html.escape(str(first["layer"]))}" '
        f'data-step="{first["step"]}" data-phase="{first["phase"]}">{html.escape(first["summary"])}</p>'
        f'<table class="kv">{body}</table></div>'
    )


# a column's title -> its key in table.COLUMNS (how its value is read from a row)
_SORT_KEY = {title: key for key, (title, _, _) in COLUMNS.items()}


def layer_table(doc: dict[str, Any]) -> str:
    """The per-layer table `hookprof top` shows, for the same snapshot the same cells
    (view/table.py formats both), by share of step time; sortable by any column."""
    table = from_document(doc)
    rows, left_out = choose(sort_rows(table.rows, "share"), TABLE_ROWS)
    if not rows:
        return '<p class="muted">no layers</p>'
    head = "".join(
        f'<th data-col="{k}"{"" if t in ("layer", "module", "NaN") else " class=num"}>{t}</th>'
        for k, t in enumerate(TITLES)
    )
    body = [_table_row(r) for r in rows]
    more = (
        f'<p class="muted">{left_out} more layers not shown (the table keeps every non-finite one)</p>'
        if left_out
        else ""
    )
    return (
        f'<table class="layers" data-model="{html.escape(doc["model"])}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>{more}"
    )


def _table_row(row: LayerRow) -> str:
    out = []
    for title, text in zip(TITLES, cells(row)):
        key = _SORT_KEY.get(title)
        value = COLUMNS[key][1](row) if key and key not in ("layer", "nan") else None
        sort = "" if value is None else f' data-sort="{value:.9g}"'
        if title == "NaN":
            out.append(f'<td class="nan-marks">{html.escape(text)}</td>')
        elif title == "share" and row.share is not None:
            width = min(max(row.share, 0.0), 1.0) * 100
            out.append(
                f'<td class="num"{sort}><span class="share-bar" style="width:{width:.1f}%"></span>'
                f"{html.escape(text)}</td>"
            )
        else:
            out.append(
                f"<td{' class=num' if title not in ('layer', 'module') else ''}{sort}>{html.escape(text)}</td>"
            )
    bad = row.first or bool(row.nonfinite)
    return f'<tr data-layer="{html.escape(row.layer)}"{" class=bad-row" if bad else ""}>{"".join(out)}</tr>'


# per column of the history: the every-step chart's title, the sampled points' title, unit
_OVER_THE_RUN = {
    "loss": ("Loss, every step", "Loss (mean over the sampled steps a point covers)", ""),
    "grad_norm": (
        "Global gradient norm, every step",
        "Global gradient norm (maximum over a point)",
        "",
    ),
    "step_seconds": (
        "Step time, ms, every step",
        "Step time, ms (mean over the steps a point covers)",
        "ms",
    ),
}


def _over_the_run(doc: dict[str, Any], xs: Any, col: str, at: int | None) -> str:
    """The loss, global gradient norm or step time chart: every step (report_steps.py)
    where the history has them, else the sampled steps' points (a document from before they
    were kept, or a run that gave no loss)."""
    hist = doc["history"]
    every = hist.get("every_step")
    every_title, points_title, unit = _OVER_THE_RUN[col]
    scale = 1e3 if unit == "ms" else 1.0
    if has_values(every, col):
        return step_chart(
            col,
            every_title,
            xs,
            every,
            col,
            at,
            doc["nonfinite_steps"],
            log_allowed=col != "step_seconds",
            unit=unit,
            scale=scale,
        )
    pts = hist["points"]
    values = [v if v is None or math.isinf(v) else v * scale for v in pts[col]]
    spans = point_spans(pts["step"], pts.get("steps", []))
    return line_chart(
        col, points_title, unit, xs, pts["step"], spans, values, at, col == "grad_norm"
    )


def model_section(doc: dict[str, Any], index: int = 0) -> str:
    hist = doc["history"]
    pts = hist["points"]
    steps = pts["step"]
    spans = point_spans(steps, pts.get("steps", []))
    xs = step_axis(last_step(doc))
    first = doc["first_nonfinite"]
    at = int(first["step"]) if first else None
    events = hist["events"]
    parts = [
        f'<section class="model" data-model="{html.escape(doc["model"])}">',
        f'<h1>{html.escape(doc["model"])} <span class="muted">rank {doc["rank"]}, hookprof '
        f"{html.escape(str(doc.get('hookprof_version', '')))}</span></h1>",
        summary(doc),
        "<h2>NaN/Inf</h2>",
        incident(doc),
    ]
    if first is not None or events:
        parts.append("<h3>When new non-finite steps were seen</h3>")
        parts.append(timeline(xs, events, hist["events_dropped"], at, f"dropped{index}"))
    parts += [
        "<h2>Over the run</h2>",
        _over_the_run(doc, xs, "loss", at),
        _over_the_run(doc, xs, "grad_norm", at),
        _over_the_run(doc, xs, "step_seconds", at),
        f'<h2>Gradient norm per layer <span class="muted">({heat_rows(hist["layers"])} layers with a '
        f"gradient norm, of {len(hist['layers'])} tracked)</span></h2>",
        heatmap(xs, steps, spans, hist["layers"], at, f"hatch{index}"),
        f'<h2>Layers <span class="muted">({len(doc["layer_totals"])} of {doc["layers_total"]} exported; '
        f"times per call over the {doc['sampled_steps']:,} sampled steps, when the per-layer hooks are in; "
        f"share: {_share_window(doc)}; as <code>hookprof top</code> shows them)"
        f"</span></h2>",
        layer_table(doc),
        "</section>",
    ]
    return "".join(parts)


def _share_window(doc: dict[str, Any]) -> str:
    """What the table's shares are of (view/table.py's _step_seconds), said in its heading."""
    if _sampled_step_ms(doc) is not None:
        return f"of the mean time of the same {doc['sampled_steps']:,} sampled steps"
    return f"of the mean step over all {doc['steps']:,} steps"


def render(documents: list[dict[str, Any]], source: str = "") -> str:
    """The whole page for one or more models' documents (report.document / report.fetch)."""
    made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    title = "hookprof report: " + ", ".join(d["model"] for d in documents)
    body = (
        "".join(model_section(d, k) for k, d in enumerate(documents))
        or "<p>No model is attached there.</p>"
    )
    where = f" from {html.escape(source)}" if source else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width"><style>{CSS}</style></head><body>'
        f'<p class="muted">hookprof run report{where}, made {made}</p>{body}'
        f'<div id="tip" class="tip"></div><script>{SCRIPT}</script></body></html>'
    )


def write(path: str, documents: list[dict[str, Any]], source: str = "") -> str:
    """The page for `documents` written to `path`; returns the path. Written whole or not
    at all (files.write_atomic): a failed write leaves the previous report as it was."""
    return write_atomic(path, render(documents, source=source))
