"""The run report: prof.report("run.html"), /history.json, `hookprof report URL -o run.html`.

The page is parsed and what it draws is checked against the history and the snapshot it
came from, and against numbers the test computed itself; the CLI runs against a real
`hookprof demo` process; a real headless chromium renders the page."""

from __future__ import annotations

import copy
import html
import json
import math
import os
import re
import shutil
import ssl
import struct
import subprocess
import time
import urllib.request
import zlib

import pytest
import torch

import hookprof
from hookprof.demo import DemoNet
from hookprof.view import table
from hookprof.view.report import from_json, history_url
from hookprof.view.report_charts import BAD, HEIGHT, PAD_B, PAD_T
from hookprof.view.report_html import render
from support.binaries import require_binaries
from support.processes import hookprof_cmd, read_until
from support.rendered import NAN_STEP, STEPS, Elements, demo_run, inside, line_of, number


def test_the_page_draws_the_history_and_the_snapshot(tmp_path):
    prof, losses = demo_run()
    try:
        path = prof.report(str(tmp_path / "run.html"))
        doc = prof.report_document()
        snap = prof.snapshot()
        top_rows = {
            r.layer: table.cells(r) for t in table.from_metrics(scrape(prof.url)) for r in t.rows
        }
    finally:
        prof.detach()
    page = open(path, encoding="utf-8").read()
    # self-contained: nothing to fetch; the one script is inline
    assert (
        not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page) and "<script src" not in page
    )
    assert (
        "@import" not in page
        and re.findall(r"url\(([^)]*)\)", page)
        and all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", page))
    )  # only the page's own patterns
    el = Elements(page)
    pts = doc["history"]["points"]
    assert pts["step"] == [
        float(s) for s in range(1, STEPS + 1)
    ]  # every step sampled: a point each

    # the loss chart: every step's value as the loop computed it; NaN from the incident on
    # drawn as red ticks on the top edge (the axis stays on the finite values: issue 41)
    (loss_chart,) = el.find("svg", **{"data-kind": "loss"})
    drawn = [number(v) for v in line_of(el, loss_chart)["data-values"].split()]
    for step, (seen, want) in enumerate(zip(drawn, losses), start=1):
        if step < NAN_STEP:
            assert math.isclose(seen, want, rel_tol=1e-6), (step, seen, want)
        else:
            assert math.isnan(want) and seen == math.inf
    ticks = el.find("rect", **{"class": "nonfinite-tick"})
    marks = [float(a["data-step"]) for a in ticks]
    assert marks and min(marks) == NAN_STEP and all(a["fill"] == BAD for a in ticks)
    # one per non-finite step drawn, loss and gradient norm charts together
    assert len(marks) == doc["nonfinite_steps"]["loss"] + doc["nonfinite_steps"]["backward"]

    for svg in el.find("svg", **{"class": "chart"}) + el.find("svg", **{"class": "heatmap"}):
        x_of = _step_axis(page, svg)
        # the incident on every chart, at its step on the axis the chart labels
        (incident,) = inside(el, svg, "line", "incident")
        assert (
            incident["data-step"] == str(NAN_STEP)
            and abs(float(incident["x1"]) - x_of(NAN_STEP)) < 0.06
        )
    for svg in el.find("svg", **{"class": "chart"}):
        x_of = _step_axis(page, svg)
        labels, values = _yticks(page, svg)
        assert len(set(labels)) == len(labels) >= 3  # no two ticks alike
        lo, hi = values[0], values[-1]
        log = svg["data-log"] == "1"
        line = line_of(el, svg)
        steps = [float(s) for s in line["data-steps"].split()]
        vals = [number(v) for v in line["data-values"].split()]
        drawn_points = [
            tuple(map(float, p.split(","))) for p in re.findall(r"-?[\d.]+,-?[\d.]+", line["d"])
        ]
        finite = [(s, v) for s, v in zip(steps, vals) if v is not None and math.isfinite(v)]
        assert len(drawn_points) == len(finite)
        for (s, v), (x, y) in zip(
            finite, drawn_points
        ):  # each point at its step and value on the labelled axes
            a, b = (math.log10(lo), math.log10(hi)) if log else (lo, hi)
            t = ((math.log10(v) if log else v) - a) / (b - a)
            assert abs(y - ((HEIGHT - PAD_B) + t * (PAD_T - (HEIGHT - PAD_B)))) <= 0.05 + 1e-6
            assert abs(x - x_of(s)) <= 0.05 + 1e-6
        # the line breaks where the values stop being finite: one piece before the incident
        assert line["d"].count("M") == 1

    # step time: the points' means, weighted by the steps they cover, add up to the total
    total = sum(s * n for s, n in zip(pts["step_seconds"], pts["steps"]))
    assert math.isclose(total, snap.step_duration_sum, rel_tol=1e-9)

    # the heatmap: a row per layer with a gradient; each cell the largest norm of the points
    # whose steps it covers; red exactly where that is not finite, from the incident on
    (heat,) = el.find("svg", **{"class": "heatmap"})
    x_of = _step_axis(page, heat)
    rows = _heat_cells(page)
    assert set(rows) == {n for n, s in snap.layers.items() if s.grad_norm is not None}
    history = {r["name"]: dict(zip(pts["step"], r["grad_norm"])) for r in doc["history"]["layers"]}
    for name, cells_ in rows.items():
        covered = []
        for cell in cells_:
            first, last = (float(v) for v in cell["data-s"].split("-"))
            in_cell = [v for s, v in history[name].items() if first <= s <= last and v is not None]
            want = max(in_cell)
            assert number(cell["data-v"]) == (
                math.inf if math.isinf(want) else float(f"{want:.6g}")
            ), (name, cell)
            assert (cell["fill"] == BAD) == math.isinf(want)
            start = max(first, NAN_STEP) - 1 if math.isinf(want) else first - 1
            assert abs(float(cell["x"]) - x_of(start)) < 0.06
            covered.append((first, last))
        assert covered[0][0] == 1 and covered[-1][1] == STEPS  # the rects tile the run
        assert all(b[0] == a[1] + 1 for a, b in zip(covered, covered[1:]))
    head_red = [c for c in rows["head"] if c["fill"] == BAD]
    assert head_red and float(head_red[0]["data-s"].split("-")[0]) == NAN_STEP

    # the per-layer table: what `hookprof top` shows for the same run, cell for cell; and
    # times per call from the snapshot's totals, "-" for a layer never called
    shown = _table_cells(page)
    assert set(shown) == set(snap.layers) == set(top_rows)
    for name, cells_ in shown.items():  # (top learns a module's class from its timing series: none
        assert cells_[2:] == top_rows[name][2:], (
            name
        )  # for a layer never called, so its module is blank)
        assert top_rows[name][1] in ("", cells_[1]) and cells_[1] == snap.layers[name].module
    for name, layer in snap.layers.items():
        fwd = shown[name][2]
        if layer.forward_calls_total:
            assert float(fwd) == pytest.approx(
                layer.forward_seconds_total / layer.forward_calls_total * 1e3, rel=0.01, abs=0.001
            )
        else:
            assert fwd == "-"
    assert shown["attn.out_proj"][2] == "-"  # used through its weight: never called, never 0 ms
    assert shown["mlp.0"][8].startswith("first")
    assert "class=bad-row" in page and re.search(r'<tr data-layer="mlp.0" class=bad-row>', page)

    # the first NaN/Inf in words, how it was found and what its replay said
    (first,) = el.find("p", **{"class": "bad first-offender"})
    assert (first["data-layer"], first["data-step"], first["data-phase"]) == (
        "mlp.0",
        str(NAN_STEP),
        "forward",
    )
    assert "first in layer mlp.0" in "".join(el.text)
    (verdict,) = el.find("span", **{"class": "verdict"})
    assert verdict["data-replay"] == snap.first_nonfinite.replay == "reproducible"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _chart_source(page: str, svg: dict) -> str:
    """The markup of one chart, found by its opening tag's attributes."""
    key = f'data-s1="{svg["data-s1"]}"'
    for chunk in re.findall(r"<svg [^>]*>.*?</svg>", page, flags=re.S):
        opening = chunk[: chunk.index(">")]
        if key in opening and svg.get("data-kind", "") in opening and svg["class"] in opening:
            return chunk
    raise AssertionError("chart not found")


def _step_axis(page: str, svg: dict):
    """x of a step, read from the chart's own labelled x ticks (two of them fix the line)."""
    ticks = [
        (float(s), float(x))
        for s, x in re.findall(
            r'class="xtick" data-step="([^"]+)" x="([^"]+)"', _chart_source(page, svg)
        )
    ]
    assert len(ticks) >= 3 and [t[0] for t in ticks] == sorted(t[0] for t in ticks)
    (s0, x0), (s1, x1) = ticks[0], ticks[-1]
    return lambda s: x0 + (s - s0) * (x1 - x0) / (s1 - s0)


def _yticks(page: str, svg: dict) -> tuple[list[str], list[float]]:
    found = re.findall(
        r'class="ytick" data-value="([^"]+)"[^>]*>([^<]+)</text>', _chart_source(page, svg)
    )
    return [label for _, label in found], [float(v) for v, _ in found]


def _heat_cells(page: str) -> dict[str, list[dict]]:
    rows = re.findall(r'<g class="row" data-layer="([^"]+)">(.*?)</g>', page)
    return {
        name: [Elements(r).tags[0][1] for r in re.findall(r"<rect [^>]*/>", body)]
        for name, body in rows
    }


def _table_cells(page: str) -> dict[str, list[str]]:
    body = re.search(r'<table class="layers".*?<tbody>(.*?)</tbody>', page, flags=re.S).group(1)
    out = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body):
        texts = [
            html.unescape(re.sub(r"<[^>]+>", "", c))
            for c in re.findall(r"<td[^>]*>(.*?)</td>", row)
        ]
        out[texts[0]] = texts
    return out


def test_under_raise_every_chart_reaches_the_incident_step(tmp_path):
    """on_nonfinite="raise" stops the loop at the incident, after the last sampled step:
    the charts' step axis still reaches it, and every chart marks it there."""
    prof, losses = demo_run(steps=40, nan_at=23, sample_every=5, on_nonfinite="raise")
    try:
        page = open(prof.report(str(tmp_path / "raise.html")), encoding="utf-8").read()
        doc = prof.report_document()
    finally:
        prof.detach()
    assert len(losses) == 22  # the loop stopped at the incident
    assert max(doc["history"]["points"]["step"]) < 23 == doc["first_nonfinite"]["step"]
    el = Elements(page)
    charts = (
        el.find("svg", **{"class": "chart"})
        + el.find("svg", **{"class": "heatmap"})
        + el.find("svg", **{"class": "timeline"})
    )
    assert len(charts) == 5
    for svg in charts:
        x_of = _step_axis(page, svg)
        assert float(svg["data-s1"]) > 23
        (mark,) = inside(el, svg, "line", "incident")
        assert abs(float(mark["x1"]) - x_of(23)) < 0.06 and float(mark["x1"]) < float(
            svg["data-x1"]
        )


@pytest.fixture(scope="module")
def small_document():
    prof, _ = demo_run(steps=8, nan_at=0)
    try:
        return prof.report_document()
    finally:
        prof.detach()


def _with(doc: dict, **changes) -> dict:
    out = copy.deepcopy(doc)
    out.update(changes)
    return out


def _event(step, new, total):
    """One kept event of the history's NaN timeline."""
    return {
        "step": step,
        "wall_time": None,
        "new_nonfinite_steps": new,
        "nonfinite_steps": total,
        "layers": ["mlp.0"],
        "more_layers": 0,
    }


def test_a_gap_never_says_more_non_finite_steps_than_there_were(small_document):
    """Issue 41: the events' counts add up the phases (a step bad in forward, backward and
    loss counts three), so a gap's count could pass the steps it spans ("4,412 events not
    kept (13,236 non-finite steps)" in 4,775 steps). It says "up to" the smaller bound."""

    events = [_event(3, 3, 3), _event(10, 3, 30)]  # 24 phase counts lost between steps 3 and 10
    hist = _with(small_document["history"], events=events, events_dropped=8)
    doc = _with(
        small_document,
        history=hist,
        steps=10,
        first_nonfinite={"layer": "mlp.0", "phase": "forward", "step": 3, "summary": "NaN at 3"},
    )
    page = render([doc])
    (gap,) = Elements(page).find("rect", **{"class": "dropped"})
    assert gap["data-steps"] == "6"  # steps 4..9
    assert "8 events not kept (up to 6 non-finite steps)" in page


def test_the_heat_maps_heading_counts_the_rows_it_draws(small_document):
    """Issue 41: "8 tracked layers" above 7 rows (a layer without parameters has no
    gradient norm, so no row)."""
    layers = small_document["history"]["layers"]
    assert layers, "the fixture tracks layers"
    silent = dict(layers[0], name="no.params", grad_norm=[None] * len(layers[0]["grad_norm"]))
    hist = _with(small_document["history"], layers=[*layers, silent])
    page = render([_with(small_document, history=hist)])
    drawn = [g["data-layer"] for g in Elements(page).find("g", **{"class": "row"})]
    heading = f"({len(drawn)} layers with a gradient norm, of {len(layers) + 1} tracked)"
    assert heading in page, re.findall(r"\(\d+ layers with a gradient norm[^)]*\)", page)
    assert "no.params" not in drawn and 0 < len(drawn) < len(layers) + 1


def test_dropped_events_are_a_labelled_gap_not_a_clean_line(small_document):
    """The history keeps the first and the latest events: where it dropped some, the
    timeline draws a hatched, labelled stretch, with the steps the counts say were lost."""

    events = [
        _event(3, 1, 1),
        _event(4, 1, 2),
        _event(700, 1, 300),
        _event(800, 2, 302),
    ]  # 297 steps lost
    hist = _with(small_document["history"], events=events, events_dropped=704)
    doc = _with(
        small_document,
        history=hist,
        steps=800,
        first_nonfinite={"layer": "mlp.0", "phase": "forward", "step": 3, "summary": "NaN at 3"},
    )
    page = render([doc])
    el = Elements(page)
    (gap,) = el.find("rect", **{"class": "dropped"})
    assert (gap["data-from"], gap["data-to"], gap["data-steps"], gap["data-events"]) == (
        "4",
        "700",
        "297",
        "704",
    )
    (svg,) = el.find("svg", **{"class": "timeline"})
    x_of = _step_axis(page, svg)
    assert (
        abs(float(gap["x"]) - x_of(4)) < 0.06
        and abs(float(gap["x"]) + float(gap["width"]) - x_of(700)) < 0.2
    )
    assert (
        gap["fill"].startswith("url(#")
        and "704 events not kept (up to 297 non-finite steps)" in page
    )
    assert [a["data-step"] for a in el.find("circle", **{"class": "event"})] == [
        "3",
        "4",
        "700",
        "800",
    ]


def test_the_incident_says_how_it_was_found_its_replay_and_its_capsule(small_document):
    first = {
        "layer": None,
        "phase": "forward",
        "step": 5,
        "propagators": [],
        "found_by": None,
        "replay": "transient",
        "replay_note": None,
        "device": "GPU-1234",
        "summary": "NaN/Inf at step 5",
        "capsule": "/runs/7/hookprof-capsule-DemoNet-rank0-step5-99.pt",
    }
    page = render([_with(small_document, first_nonfinite=first)])
    el = Elements(page)
    (verdict,) = el.find("span", **{"class": "verdict"})
    assert verdict["data-replay"] == "transient"
    text = "".join(el.text)
    assert (
        "no layer named (forward phase), step 5" in text
        and "suspect a non-deterministic kernel" in text
    )
    assert (
        "hookprof replay /runs/7/hookprof-capsule-DemoNet-rank0-step5-99.pt" in text
        and "GPU-1234" in text
    )
    # before issue 31's field exists: no capsule row, nothing else missing
    del first["capsule"]
    page = render([_with(small_document, first_nonfinite=first)])
    assert "hookprof replay" not in page and 'data-replay="transient"' in page


def test_narrow_ranges_get_distinct_ticks_and_missing_values_break_the_line(small_document):
    every = small_document["history"]["every_step"]
    n = len(every["full"]["step"])
    loss = [2.3012 + 0.001 * (k % 3) for k in range(n)]
    loss[3] = None  # no loss given at that step: a gap, not a line across it
    hist = _with(
        small_document["history"], every_step={**every, "full": {**every["full"], "loss": loss}}
    )
    page = render([_with(small_document, history=hist)])
    el = Elements(page)
    (svg,) = el.find("svg", **{"data-kind": "loss"})
    labels, values = _yticks(page, svg)
    assert (
        len(set(labels)) == len(labels) >= 3
        and values[0] <= min(v for v in loss if v)
        and values[-1] >= max(v for v in loss if v)
    )
    assert [float(t) for t in labels] == pytest.approx(values)  # a label is its tick's value
    assert line_of(el, svg)["d"].count("M") == 2


def test_history_json_is_served_with_the_metrics(tmp_path):
    prof, _ = demo_run(steps=12, nan_at=0)
    try:
        with urllib.request.urlopen(history_url(prof.url), timeout=10) as response:
            assert response.headers["Content-Type"] == "application/json"
            body = response.read()
        json.loads(body)  # strict JSON: no NaN/Infinity literals
        (doc,) = from_json(body)
        mine = prof.report_document()
    finally:
        prof.detach()
    assert doc["model"] == "DemoNet" and doc["steps"] == 12
    assert doc["history"]["points"]["step"] == [float(s) for s in range(1, 13)]
    assert doc["history"] == mine["history"]
    assert doc["first_nonfinite"] is None


def test_history_json_keeps_the_endpoints_tls_and_client_certificates(pki, tmp_path):
    cert, key = pki["server"]
    prof, _ = demo_run(
        steps=5, nan_at=0, tls_certfile=cert, tls_keyfile=key, tls_client_cafile=pki["ca"]
    )
    try:
        url = prof.url
        out = tmp_path / "tls.html"
        ok = subprocess.run(
            hookprof_cmd(
                "report",
                url,
                "-o",
                str(out),
                "--cacert",
                pki["ca"],
                "--cert",
                pki["client"][0],
                "--key",
                pki["client"][1],
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        refused = subprocess.run(
            hookprof_cmd("report", url, "-o", str(tmp_path / "no.html"), "--cacert", pki["ca"]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        plain = urllib.request.Request(history_url(url))
        context = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((ssl.SSLError, OSError)):
            urllib.request.urlopen(plain, timeout=10, context=context).read()
    finally:
        prof.detach()
    assert ok.returncode == 0, ok.stderr
    assert 'class="line"' in out.read_text()
    assert (
        refused.returncode == 1
        and "cannot read" in refused.stderr
        and "pass --cert and --key" in refused.stderr
    )
    assert not (tmp_path / "no.html").exists()


@pytest.mark.slow
def test_the_cli_reports_a_running_demo(tmp_path):
    demo = subprocess.Popen(
        hookprof_cmd(
            "demo",
            "--port",
            "0",
            "--steps",
            "0",
            "--nan-at-step",
            "25",
            "--sample-every",
            "1",
            "--min-sample-interval",
            "0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = re.search(r"(http://\S+)", read_until(demo.stdout, "serving metrics at")).group(1)
        deadline = time.monotonic() + 120
        while True:  # until the demo has gone past its NaN and the publisher has told
            with urllib.request.urlopen(history_url(url), timeout=10) as response:
                (doc,) = from_json(response.read())
            if (doc["first_nonfinite"] or {}).get("layer") or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        out = tmp_path / "run.html"
        result = subprocess.run(
            hookprof_cmd("report", url, "-o", str(out)), capture_output=True, text=True, timeout=120
        )
    finally:
        demo.terminate()
        try:
            demo.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.communicate()
    assert result.returncode == 0, result.stderr
    assert f"wrote {out} (DemoNet)" in result.stdout
    el = Elements(out.read_text())
    (first,) = el.find("p", **{"class": "bad first-offender"})
    assert (first["data-layer"], first["data-step"]) == ("mlp.0", "25")
    (loss_chart,) = el.find("svg", **{"data-kind": "loss"})
    steps = [float(s) for s in line_of(el, loss_chart)["data-steps"].split()]
    # every step's loss (issue 41): the latest ones one by one, up to the last step served
    assert steps == sorted(steps) and steps[-1] >= 25
    assert steps[-12:] == [steps[-1] - k for k in range(11, -1, -1)]
    assert {a["data-layer"] for a in el.find("tr") if "data-layer" in a} >= {
        "embed",
        "attn",
        "mlp.0",
        "head",
    }


def test_the_cli_says_why_when_nothing_serves(tmp_path):
    from support.ports import free_port

    result = subprocess.run(
        hookprof_cmd(
            "report", f"127.0.0.1:{free_port()}", "-o", str(tmp_path / "x.html"), "--timeout", "5"
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "cannot read http://127.0.0.1:" in result.stderr and "/history.json" in result.stderr


# ---------------- a real browser ----------------


def png_pixels(path: str) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) bytes of an 8-bit PNG (chromium's screenshots),
    unfiltered here: no imaging library needed."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for r in range(height):
        f, line = (
            raw[r * (stride + 1)],
            bytearray(raw[r * (stride + 1) + 1 : (r + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, stride, bpp)]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        return require_binaries("chromium")[0]  # skips here, fails in CI (.ci/run installs it)
    return found


def console_errors(stderr: str) -> list[str]:
    """What chromium logged from the page itself (its console, uncaught errors), not its own
    complaints about the sandboxed machine (no D-Bus, no GPU)."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def run_chromium(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={cwd}/profile",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


PROBE = """<script>
window.addEventListener('load', function () {
  function at(svg, step, y) {  // where a person's pointer is over `step` of a chart, in the window
    var d = svg.dataset, p = svg.createSVGPoint();
    p.x = +d.x0 + (step - d.s0) / (d.s1 - d.s0) * (d.x1 - d.x0); p.y = y;
    return p.matrixTransform(svg.getScreenCTM());
  }
  function hover(svg, step, y) {
    svg.scrollIntoView({block: 'center'});
    var p = at(svg, step, y), target = document.elementFromPoint(p.x, p.y);
    target.dispatchEvent(new MouseEvent('mousemove', {clientX: p.x, clientY: p.y, bubbles: true}));
    return document.getElementById('tip').textContent;
  }
  var loss = document.querySelector('svg[data-kind=loss]'), heat = document.querySelector('svg.heatmap');
  var firstRow = heat.querySelector('g.row rect');
  var out = {
    page: document.documentElement.clientWidth,
    charts: Array.prototype.map.call(document.querySelectorAll('svg.chart, svg.heatmap'),
                                     function (s) { return s.getBoundingClientRect().width; }),
    label_fill: getComputedStyle(document.querySelector('.incident-label')).fill,
    nan_colour: getComputedStyle(document.querySelector('td.nan-marks')).color,
    loss_tip: hover(loss, PROBE_STEP, 100),
    heat_tip: hover(heat, PROBE_NAN, +firstRow.getAttribute('y') + 5),
  };
  var pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.mark.slow
def test_a_real_browser_renders_the_page_without_errors(tmp_path):
    """What a person sees at 1400 pixels, for a NaN at step 50 of 80 with every 5th step
    sampled: charts across the page, red marks red, hover values that are the history's."""
    browser = chromium()
    assert browser
    # first, that a page's errors do show where this test looks for them
    control = tmp_path / "control.html"
    control.write_text(
        "<!DOCTYPE html><html><body><script>no_such_function()</script></body></html>"
    )
    seen = run_chromium(
        "--dump-dom", "--enable-logging=stderr", "--v=0", f"file://{control}", cwd=str(tmp_path)
    )
    assert "no_such_function" in "".join(console_errors(seen.stderr)), seen.stderr[-2000:]

    prof, _ = demo_run(steps=80, nan_at=50, sample_every=5)
    try:
        path = prof.report(str(tmp_path / "run.html"))
        doc = prof.report_document()
    finally:
        prof.detach()
    url = "file://" + path
    dom = run_chromium(
        "--dump-dom",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1400,1000",
        url,
        cwd=str(tmp_path),
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the DOM chromium built has every chart, and the console saw no error
    assert dom.stdout.count('class="chart"') == 3 and 'class="heatmap"' in dom.stdout
    assert "first in layer mlp.0" in dom.stdout
    assert not console_errors(dom.stderr), console_errors(dom.stderr)

    # the page as a person's pointer finds it: the same file with a probe script after it
    probe_step = 30
    probed = tmp_path / "probed.html"
    probed.write_text(
        open(path, encoding="utf-8")
        .read()
        .replace(
            "</body>",
            PROBE.replace("PROBE_STEP", str(probe_step)).replace("PROBE_NAN", "65") + "</body>",
        )
    )
    seen = run_chromium(
        "--dump-dom",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1400,1000",
        f"file://{probed}",
        cwd=str(tmp_path),
    )
    assert not console_errors(seen.stderr), console_errors(seen.stderr)
    probe = json.loads(
        html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', seen.stdout, flags=re.S).group(1))
    )
    assert all(w >= 0.9 * probe["page"] for w in probe["charts"]), probe  # the charts use the width
    assert probe["label_fill"] == probe["nan_colour"] == "rgb(214, 39, 40)", (
        probe
    )  # red text is red
    # the loss of every step, not only of the sampled ones (issue 41): the step under the pointer
    full = doc["history"]["every_step"]["full"]
    tip = re.fullmatch(r"step (\d+): ([\d.]+)", probe["loss_tip"])
    assert tip, probe["loss_tip"]
    assert int(tip[1]) == probe_step
    assert float(tip[2]) == pytest.approx(full["loss"][full["step"].index(probe_step)], rel=1e-4)
    assert "gradient norm NaN/Inf" in probe["heat_tip"] and probe["heat_tip"].startswith(
        "embed, steps"
    )

    shot = tmp_path / "shot.png"
    run = run_chromium(f"--screenshot={shot}", "--window-size=1400,1800", url, cwd=str(tmp_path))
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    width, height, pixels = png_pixels(str(shot))
    assert (width, height) == (1400, 1800)
    red = sum(p == bytes.fromhex("d62728") for p in pixels)  # non-finite bands, heatmap cells
    blue = [i % width for i, p in enumerate(pixels) if p == bytes.fromhex("1f77b4")]  # the lines
    assert red > 5000 and blue, red
    assert max(blue) - min(blue) > 0.5 * width  # lines across the page, not a third of it


def test_a_report_after_detach_and_under_hookprof_disable(tmp_path, monkeypatch):
    prof, losses = demo_run(steps=6, nan_at=0)
    prof.detach()
    page = open(prof.report(str(tmp_path / "after.html")), encoding="utf-8").read()
    el = Elements(page)
    (loss_chart,) = el.find("svg", **{"data-kind": "loss"})
    drawn = [number(v) for v in line_of(el, loss_chart)["data-values"].split()]
    assert [round(v, 5) for v in drawn] == [round(v, 5) for v in losses]
    assert "No NaN or Inf in any step so far" in page

    monkeypatch.setenv("HOOKPROF_DISABLE", "1")
    disabled = hookprof.attach(DemoNet())
    path = disabled.report(str(tmp_path / "disabled.html"))
    assert disabled.report() in open(path, encoding="utf-8").read()  # says why it is empty
    assert "hookprof is disabled" in disabled.report()


def test_one_endpoint_two_models_two_sections(tmp_path):
    from hookprof.view.report import fetch
    from hookprof.view.report_html import render
    from support.ports import free_port

    port = free_port()
    torch.manual_seed(0)
    models = {"G": DemoNet(), "D": DemoNet(dim=32)}
    profs = {
        name: hookprof.attach(m, port=port, name=name, sample_every=1, min_sample_interval_s=0.0)
        for name, m in models.items()
    }
    try:
        generator = torch.Generator().manual_seed(0)
        steps = {"G": 3, "D": 5}
        for name, m in models.items():
            optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
            for _ in range(steps[name]):
                tokens, labels = m.batch(generator)
                torch.nn.functional.cross_entropy(m(tokens), labels).backward()
                optimizer.step()
                optimizer.zero_grad()
            profs[name].flush()
        documents = fetch(f"127.0.0.1:{port}")
    finally:
        for prof in profs.values():
            prof.detach()
    assert {d["model"]: d["steps"] for d in documents} == steps
    assert {d["model"]: len(d["history"]["points"]["step"]) for d in documents} == steps
    el = Elements(render(documents))
    assert sorted(a["data-model"] for a in el.find("section")) == ["D", "G"]
    assert len(el.find("svg", **{"data-kind": "step_seconds"})) == 2
    assert not el.find(
        "svg", **{"data-kind": "loss"}
    )  # no loss given: "no values yet", no empty chart


def test_a_last_sampled_value_from_before_the_incident_says_so(small_document):
    """A short run with few sampled steps: the loss and gradient norm tiles show the last
    sampled step's (finite) values; when the first NaN/Inf came after it, the tiles say at
    which step they were taken and from which step the run was non-finite (a new user read
    `loss 2.514` as the loss at the end of a run whose loss was NaN from step 120)."""
    last = int(small_document["history"]["points"]["step"][-1])
    after = _with(
        small_document,
        first_nonfinite={
            "layer": "(input)",
            "phase": "forward",
            "step": last + 5,
            "summary": "NaN",
        },
    )
    page = render([after])
    assert (
        page.count(f"at step {last:,}; NaN/Inf from step {last + 5:,}") == 2
    )  # loss and gradient norm
    before = _with(
        small_document,
        first_nonfinite={"layer": "(input)", "phase": "forward", "step": 1, "summary": "NaN"},
    )
    assert "NaN/Inf from step" not in render([before])
