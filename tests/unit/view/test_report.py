"""The run report: prof.report("run.html"), /history.json, `hookprof report URL -o run.html`.

The page is parsed and what it draws is checked against the history and the snapshot it
came from, and against numbers the test computed itself; the CLI runs against a real
`hookprof demo` process; a real headless chromium renders the page."""

from __future__ import annotations

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
from hookprof.view.report import from_json, history_url
from hookprof.view.report_html import HEIGHT, PAD_B, PAD_T
from support.binaries import require_binaries
from support.processes import hookprof_cmd, read_until
from support.rendered import NAN_STEP, STEPS, Elements, demo_run, line_of, number

def test_the_page_draws_the_history_and_the_snapshot(tmp_path):
    prof, losses = demo_run()
    try:
        path = prof.report(str(tmp_path / "run.html"))
        doc = prof.report_document()
        snap = prof.snapshot()
    finally:
        prof.detach()
    page = open(path, encoding="utf-8").read()
    # self-contained: nothing to fetch, no script
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page) and "<script" not in page
    assert "@import" not in page and "url(" not in page
    el = Elements(page)
    pts = doc["history"]["points"]
    assert pts["step"] == [float(s) for s in range(1, STEPS + 1)]  # every step sampled: a point each

    # the loss chart: the values the loop computed; NaN from the incident on drawn as marks
    (loss_chart,) = el.find("svg", **{"data-kind": "loss"})
    loss_line = line_of(el, loss_chart)
    drawn = [number(v) for v in loss_line["data-values"].split()]
    for step, (seen, want) in enumerate(zip(drawn, losses), start=1):
        if step < NAN_STEP:
            assert math.isclose(seen, want, rel_tol=1e-6), (step, seen, want)
        else:
            assert math.isnan(want) and seen == math.inf
    marks = [float(a["data-step"]) for a in el.find("line", **{"class": "nonfinite"})]
    assert marks and min(marks) == NAN_STEP

    # each chart's polyline: its y coordinates are its values on the axis it labels
    for svg in el.find("svg", **{"class": "chart"}):
        line = line_of(el, svg)
        ticks = _ticks_of(el, svg)
        lo, hi = ticks[0], ticks[-1]
        log = svg["data-log"] == "1"
        finite = [v for v in (number(x) for x in line["data-values"].split()) if v is not None and math.isfinite(v)]
        ys = [float(p.split(",")[1]) for p in line["points"].split()]
        assert len(ys) == len(finite)
        for v, y in zip(finite, ys):
            a, b = (math.log10(lo), math.log10(hi)) if log else (lo, hi)
            t = ((math.log10(v) if log else v) - a) / (b - a)
            assert abs(y - ((HEIGHT - PAD_B) + t * (PAD_T - (HEIGHT - PAD_B)))) <= 0.05 + 1e-6  # one decimal in the SVG

    # step time: the points' means, weighted by the steps they cover, add up to the total
    total = sum(s * n for s, n in zip(pts["step_seconds"], pts["steps"]))
    assert math.isclose(total, snap.step_duration_sum, rel_tol=1e-9)

    # bars: mean forward/backward ms per sampled step, as the snapshot's totals say
    bars = {a["data-layer"]: float(a["data-ms"]) for a in el.find("rect", **{"class": "fwd"})}
    assert set(bars) == set(snap.layers)
    for name, ms in bars.items():
        want = snap.layers[name].forward_seconds_total / snap.sampled_steps * 1e3
        assert math.isclose(ms, want, rel_tol=1e-5), name
    widths = {a["data-layer"]: float(a["width"]) for a in el.find("rect", **{"class": "fwd"})}
    busiest = max(bars, key=bars.get)
    for name in bars:  # widths proportional to the times
        assert abs(widths[name] / widths[busiest] - bars[name] / bars[busiest]) < 0.01

    # the heatmap: one row per layer with a gradient; red (non-finite) from the incident on
    rows = [a["data-layer"] for a in el.find("g", **{"class": "row"})]
    assert set(rows) == {n for n, s in snap.layers.items() if s.grad_norm is not None}
    cells = _heat_cells(page)
    hist_rows = {r["name"]: r["grad_norm"] for r in doc["history"]["layers"]}
    for name in rows:
        assert [number(v) for v in cells[name]] == [
            None if v is None else float(f"{v:.9g}") if math.isfinite(v) else math.inf for v in hist_rows[name]]
    assert cells["head"][NAN_STEP - 2] != "NaN/Inf" and cells["head"][NAN_STEP] == "NaN/Inf"

    # the NaN timeline names the first offender
    (first,) = el.find("p", **{"class": "bad first-offender"})
    assert (first["data-layer"], first["data-step"], first["data-phase"]) == ("mlp.0", str(NAN_STEP), "forward")
    assert "first in layer mlp.0" in "".join(el.text)


def _ticks_of(el: Elements, svg: dict) -> list[float]:
    seen, ticks = False, []
    for tag, attrs in el.tags:
        if attrs is svg:
            seen = True
        elif seen and tag == "svg":
            break
        elif seen and attrs.get("class") == "ytick":
            ticks.append(float(attrs["data-value"]))
    return ticks


def _heat_cells(page: str) -> dict[str, list[str]]:
    rows = re.findall(r'<g class="row" data-layer="([^"]+)">(.*?)</g>', page)
    return {name: re.findall(r'data-v="([^"]+)"', body) for name, body in rows}


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
    prof, _ = demo_run(steps=5, nan_at=0, tls_certfile=cert, tls_keyfile=key, tls_client_cafile=pki["ca"])
    try:
        url = prof.url
        out = tmp_path / "tls.html"
        ok = subprocess.run(hookprof_cmd("report", url, "-o", str(out), "--cacert", pki["ca"],
                                         "--cert", pki["client"][0], "--key", pki["client"][1]),
                            capture_output=True, text=True, timeout=120)
        refused = subprocess.run(hookprof_cmd("report", url, "-o", str(tmp_path / "no.html"), "--cacert", pki["ca"]),
                                 capture_output=True, text=True, timeout=120)
        plain = urllib.request.Request(history_url(url))
        context = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((ssl.SSLError, OSError)):
            urllib.request.urlopen(plain, timeout=10, context=context).read()
    finally:
        prof.detach()
    assert ok.returncode == 0, ok.stderr
    assert "<polyline" in out.read_text()
    assert refused.returncode == 1 and "cannot read" in refused.stderr and "pass --cert and --key" in refused.stderr
    assert not (tmp_path / "no.html").exists()


@pytest.mark.slow
def test_the_cli_reports_a_running_demo(tmp_path):
    demo = subprocess.Popen(
        hookprof_cmd("demo", "--port", "0", "--steps", "0", "--nan-at-step", "25", "--sample-every", "1",
                     "--min-sample-interval", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
        result = subprocess.run(hookprof_cmd("report", url, "-o", str(out)), capture_output=True, text=True, timeout=120)
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
    # every step sampled, from the first: a point per step, or per `stride` steps once the
    # demo ran past the history's size (it keeps the later step of two merged points)
    stride = int(steps[0])
    assert stride & (stride - 1) == 0
    assert steps[:12] == [float(stride * k) for k in range(1, 13)]
    assert {a["data-layer"] for a in el.find("rect", **{"class": "fwd"})} >= {"embed", "attn", "mlp.0", "head"}


def test_the_cli_says_why_when_nothing_serves(tmp_path):
    from support.ports import free_port

    result = subprocess.run(hookprof_cmd("report", f"127.0.0.1:{free_port()}", "-o", str(tmp_path / "x.html"),
                                         "--timeout", "5"), capture_output=True, text=True, timeout=120)
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
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
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
        f, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
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
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


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
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", f"--user-data-dir={cwd}/profile", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.slow
def test_a_real_browser_renders_the_page_without_errors(tmp_path):
    browser = chromium()
    assert browser
    # first, that a page's errors do show where this test looks for them
    control = tmp_path / "control.html"
    control.write_text("<!DOCTYPE html><html><body><script>no_such_function()</script></body></html>")
    seen = run_chromium("--dump-dom", "--enable-logging=stderr", "--v=0", f"file://{control}", cwd=str(tmp_path))
    assert "no_such_function" in "".join(console_errors(seen.stderr)), seen.stderr[-2000:]

    prof, _ = demo_run(steps=30, nan_at=20)
    try:
        path = prof.report(str(tmp_path / "run.html"))
    finally:
        prof.detach()
    url = "file://" + path
    dom = run_chromium("--dump-dom", "--enable-logging=stderr", "--v=0", url, cwd=str(tmp_path))
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the DOM chromium built has every chart, and the console saw no error
    assert dom.stdout.count('class="chart"') == 3 and 'class="heatmap"' in dom.stdout
    assert "first in layer mlp.0" in dom.stdout
    assert not console_errors(dom.stderr), console_errors(dom.stderr)
    shot = tmp_path / "shot.png"
    run = run_chromium(f"--screenshot={shot}", "--window-size=800,1200", url, cwd=str(tmp_path))
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    width, height, pixels = png_pixels(str(shot))
    assert (width, height) == (800, 1200)
    red = sum(p == bytes.fromhex("d62728") for p in pixels)  # non-finite marks and heatmap cells
    blue = sum(p == bytes.fromhex("1f77b4") for p in pixels)  # forward bars
    white = sum(p == b"\xff\xff\xff" for p in pixels)
    assert red > 500 and blue > 500, (red, blue)
    assert white < len(pixels) * 0.99  # a blank page is all white


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
    from support.ports import free_port
    from hookprof.view.report import fetch
    from hookprof.view.report_html import render

    port = free_port()
    torch.manual_seed(0)
    models = {"G": DemoNet(), "D": DemoNet(dim=32)}
    profs = {name: hookprof.attach(m, port=port, name=name, sample_every=1, min_sample_interval_s=0.0)
             for name, m in models.items()}
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
    assert not el.find("svg", **{"data-kind": "loss"})  # no loss given: "no values yet", no empty chart
