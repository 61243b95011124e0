"""`hookprof top`'s lines of recent steps (issue 41): read from the real endpoint's
/history.json?recent, one character per step, `!` exactly where the loop's loss was not
finite, and the steps up to the first NaN/Inf once the run went past them."""

from __future__ import annotations

import math
import re
import subprocess
import urllib.request

from hookprof.serve.server import RECENT_STEPS
from hookprof.view.recent import LEVELS, NONFINITE, WIDTH, recent_lines, spark
from hookprof.view.report import from_json, history_url
from hookprof.view.top import Scraper
from support.processes import hookprof_cmd
from support.rendered import demo_run


def test_spark_levels_follow_the_values():
    values = [1.0, 2.0, None, 3.0, math.inf, 4.0]
    drawn = spark(values)
    assert len(drawn) == len(values)
    assert drawn[2] == " " and drawn[4] == NONFINITE
    heights = [LEVELS.index(c) for c in drawn if c in LEVELS]
    assert heights == sorted(heights) and heights[0] == 0 and heights[-1] == len(LEVELS) - 1
    # a log scale where the values span more than 1000x: 1, 10, ..., 1e6 evenly spaced
    steps = [LEVELS.index(c) for c in spark([10.0**k for k in range(7)])]
    assert steps == sorted(steps) and len(set(steps)) == 7


def test_top_shows_each_recent_step_and_the_lead_up(tmp_path):
    nan_at, steps = 40, 200  # past WIDTH steps after the NaN: the lead-up gets a line
    prof, losses = demo_run(steps=steps, nan_at=nan_at)
    try:
        with urllib.request.urlopen(history_url(prof.url) + "?recent", timeout=10) as r:
            body = r.read()
        (doc,) = from_json(body)
        tables, errors = Scraper([prof.url]).look()
        once = subprocess.run(
            hookprof_cmd("top", "--once", prof.url, "--interval", "0"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        prof.detach()
    assert not errors
    assert len(body) < 20_000  # asked every second: a few KB, not the whole history
    assert doc["recent"]["step"] == [float(s) for s in range(steps - RECENT_STEPS + 1, steps + 1)]
    (table,) = tables
    recent, lead_up = table.header.recent.split("\n  ")
    drawn = re.search(r"loss \[(.*?)\]", recent)[1]
    assert drawn == NONFINITE * WIDTH  # NaN ever since step 40
    first, last = map(int, re.search(r"steps ([\d,]+)-([\d,]+)", lead_up).groups())
    assert last == nan_at and last - first + 1 == min(WIDTH, nan_at)
    drawn = re.search(r"loss \[(.*?)\]", lead_up)[1]
    want = [losses[s - 1] for s in range(first, last + 1)]
    assert [c == NONFINITE for c in drawn] == [not math.isfinite(v) for v in want]
    # the highest character where the loop's loss was highest among the finite ones
    finite = [(v, k) for k, v in enumerate(want) if math.isfinite(v)]
    assert drawn[max(finite)[1]] == LEVELS[-1] and drawn[min(finite)[1]] == LEVELS[0]
    assert once.returncode == 0, once.stderr
    assert "up to the first NaN/Inf: steps" in once.stdout


def test_the_lead_up_line_shows_when_the_incident_is_off_the_drawn_steps():
    """An incident 100 steps back is in the 120 fetched but not in the 60 drawn: the steps up
    to it get their own line (review of issue 41: it was hidden for up to 60 steps)."""
    steps = [float(s) for s in range(981, 1101)]  # the 120 steps /history.json?recent sends
    recent = {"step": steps, "loss": [1.0] * 120, "grad_norm": [1.0] * 120}
    lead_up = {"step": [991.0, 992.0, 1000.0], "loss": [1.0, 2.0, math.inf], "grad_norm": [1.0] * 3}
    line = recent_lines({"recent": recent, "lead_up": lead_up})
    assert line is not None and "up to the first NaN/Inf: steps 991-1,000" in line
    # an incident among the drawn steps shows there: no second line
    lead_up_drawn = {**lead_up, "step": [1050.0, 1051.0, 1060.0]}
    assert "up to the first" not in recent_lines({"recent": recent, "lead_up": lead_up_drawn})
