"""docs/metrics.md is the metric contract: it lists exactly the series that
hookprof/metrics_names.py defines, with their types and labels, and exactly the series a real
`hookprof demo` process exports over HTTP (every feature switched on, a NaN injected, a stall
provoked), the rows marked GPU only aside: this machine has no GPU.

Names are compared as a query writes them: a counter's with _total (prometheus_client's parser
drops it from the family name), a summary's or histogram's without _sum/_count/_bucket. Labels
are compared where the page has samples to read them from; `le` and `quantile` are the
exposition's, not the metric's."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hookprof import metrics_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "metrics.md"
HEADER = ("metric", "type", "labels", "present", "meaning")
GPU_ONLY = "**GPU only**"  # how a row's "present" cell says it cannot appear without a GPU
PORT_CONFLICT_ONLY = (
    "**port conflict only**"  # ... that it needs a taken metrics port (the demo picks a free one)
)
# ... that it needs a loop that drops non-finite gradients (the demo's NaN reaches its update);
# scraped and checked in tests/unit/step/test_backward_end.py
DROPPED_ONLY = "**a dropped step only**"
# ... that it needs a replay check or a spike's replay that did not reproduce (a fault the demo
# has not); scraped and checked in tests/behaviour/test_replay_check.py and
# tests/behaviour/test_spike_replay.py
MISMATCH_ONLY = "**a replay mismatch only**"
# ... that it needs parameters changed between a check step's forward and its update (a fault
# the demo has not); scraped and checked in tests/behaviour/test_parameter_watch.py
CHANGE_ONLY = "**a change only**"
EXPOSITION_LABELS = {"le", "quantile"}

# the demo with every family on: sampled every step, activation statistics and update norms on
# every sampled step, a peak FLOP/s so the utilisation exists, gradient norms above 1e-3
# flagged "exploding", the system sampler every 0.2 s, and a stall threshold that the demo's
# idle wait after its last step crosses
DEMO_ENV = {
    "HOOKPROF_ACTIVATION_INTERVAL_S": "0",
    "HOOKPROF_UPDATE_NORM_INTERVAL_S": "0",
    "HOOKPROF_PEAK_FLOPS": "1e12",
    "HOOKPROF_EXPLODING_GRAD_NORM": "1e-3",
    "HOOKPROF_SYSTEM_INTERVAL_S": "0.2",
    "HOOKPROF_STALL_MIN_S": "0.5",
    "HOOKPROF_SDC_CHECK_INTERVAL_S": "0.05",  # the replica check's two gauges
    "HOOKPROF_SPIKE_REPLAY": "1",  # hookprof_spike_replays_total (each result from 0)
    "HOOKPROF_SUMMARY_AT_EXIT": "0",
}
DEMO_ARGS = (
    "demo",
    "--addr",
    "127.0.0.1",
    "--port",
    "0",
    "--steps",
    "30",
    "--nan-at-step",
    "20",
    "--sample-every",
    "1",
    "--min-sample-interval",
    "0",
)
START_TIMEOUT_S = 60.0  # torch's import on a loaded 2-core machine
COMPLETE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    labels: frozenset[str] | None  # None: not known (a family without samples)
    gpu_only: bool = (
        False  # (or port conflict only, or a dropped step only: never on the demo's page here)
    )


def documented(text: str) -> dict[str, Row]:
    """The rows of every table of docs/metrics.md with the contract's header."""
    rows: dict[str, Row] = {}
    in_table = False
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|")
            else None
        )
        if cells is None:
            in_table = False
        elif tuple(cells) == HEADER:
            in_table = True
        elif in_table and not set(line) <= set("|-: "):
            assert len(cells) == len(HEADER), f"a row of {len(cells)} cells: {line}"
            name = re.fullmatch(r"`([a-zA-Z_:][a-zA-Z0-9_:]*)`", cells[0])
            assert name, f"a metric cell that is not one `name`: {line}"
            assert name[1] not in rows, f"{name[1]} documented twice"
            rows[name[1]] = Row(
                name[1],
                cells[1],
                frozenset(re.findall(r"`([^`]+)`", cells[2])),
                any(
                    only in cells[3]
                    for only in (
                        GPU_ONLY,
                        PORT_CONFLICT_ONLY,
                        DROPPED_ONLY,
                        MISMATCH_ONLY,
                        CHANGE_ONLY,
                    )
                ),
            )
    return rows


def exported(page: str) -> dict[str, Row]:
    """The families of an exposition, named as a query names them."""
    rows = {}
    for family in text_string_to_metric_families(page):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels} - EXPOSITION_LABELS
        rows[name] = Row(name, family.type, frozenset(labels) if family.samples else None)
    return rows


def defined() -> dict[str, Row]:
    return {m.name: Row(m.name, m.kind, frozenset(m.exported_labels)) for m in metrics_names.ALL}


def disagreements(
    docs: dict[str, Row], other: dict[str, Row], where: str, gpu_rows_may_be_absent: bool = False
) -> list[str]:
    """What docs and `other` (named `where`) disagree on, one line each; [] when they agree."""
    problems = []
    for name, row in sorted(docs.items()):
        if name not in other:
            if not (gpu_rows_may_be_absent and row.gpu_only):
                problems.append(f"{name}: documented, not in {where}")
            continue
        theirs = other[name]
        if theirs.kind != row.kind:
            problems.append(f"{name}: documented as a {row.kind}, a {theirs.kind} in {where}")
        if theirs.labels is not None and theirs.labels != row.labels:
            problems.append(
                f"{name}: documented labels {sorted(row.labels)}, "
                f"{sorted(theirs.labels)} in {where}"
            )
    problems += [f"{name}: in {where}, not documented" for name in sorted(set(other) - set(docs))]
    return problems


# ---- the contract ----


def test_the_docs_list_exactly_what_metrics_names_defines():
    assert disagreements(documented(DOCS.read_text()), defined(), "metrics_names.py") == []


def test_the_docs_list_exactly_what_the_demo_exports(demo_page):
    docs = documented(DOCS.read_text())
    assert (
        disagreements(docs, exported(demo_page), "the demo's page", gpu_rows_may_be_absent=True)
        == []
    )
    # and the page's help texts are the module's (one wording per series)
    helps = {f.name: f.documentation for f in text_string_to_metric_families(demo_page)}
    assert {m.family_name: m.help for m in metrics_names.ALL if m.family_name in helps} == helps


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory) -> str:
    """The /metrics page of a real `hookprof demo` once every series the docs promise on a
    CPU is on it (or COMPLETE_TIMEOUT_S passed: the test then says what is missing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKPROF_")}
    env.update(
        DEMO_ENV,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        HOOKPROF_CAPSULE_DIR=str(tmp_path_factory.mktemp("capsules")),
    )  # its NaN's capsule
    proc = subprocess.Popen(
        [sys.executable, "-m", "hookprof.cli", *DEMO_ARGS],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = _served_url(proc)
        wanted = {name for name, row in documented(DOCS.read_text()).items() if not row.gpu_only}
        deadline = time.monotonic() + COMPLETE_TIMEOUT_S
        while True:
            with urllib.request.urlopen(url, timeout=10) as response:
                page = response.read().decode()
            if wanted <= set(exported(page)) or time.monotonic() > deadline:
                return page
            time.sleep(0.3)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _served_url(proc: subprocess.Popen) -> str:
    """The URL the demo prints, read by a thread (a readline could wait forever) that keeps
    draining its output so that the child never blocks on a full pipe."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        found = re.search(r"serving metrics at (http://\S+)", line)
        if found:
            return found[1]
    raise AssertionError("the demo never said where it serves:\n" + "".join(seen))


# ---- the comparison can fail, both ways ----

ROW = (
    "| `hookprof_held_back_updates_total` | counter | `model`, `rank` | always | optimizer "
    'updates of non-finite steps hookprof held back (`on_nonfinite="skip"` or `"raise"`) |'
)


def test_the_docs_row_this_file_edits_is_there():
    assert ROW in DOCS.read_text().splitlines()


def test_a_row_missing_from_the_docs_is_reported():
    docs = documented(DOCS.read_text().replace(ROW + "\n", ""))
    assert disagreements(docs, defined(), "metrics_names.py") == [
        "hookprof_held_back_updates_total: in metrics_names.py, not documented"
    ]


def test_a_row_too_many_in_the_docs_is_reported():
    extra = ROW.replace("held_back_updates", "made_up")
    docs = documented(DOCS.read_text().replace(ROW, f"{ROW}\n{extra}"))
    assert disagreements(docs, defined(), "metrics_names.py") == [
        "hookprof_made_up_total: documented, not in metrics_names.py"
    ]


def test_wrong_labels_and_type_in_the_docs_are_reported():
    wrong = ROW.replace("| counter | `model`, `rank` |", "| gauge | `model`, `rank`, `phase` |")
    docs = documented(DOCS.read_text().replace(ROW, wrong))
    assert disagreements(docs, defined(), "metrics_names.py") == [
        "hookprof_held_back_updates_total: documented as a gauge, a counter in metrics_names.py",
        "hookprof_held_back_updates_total: documented labels ['model', 'phase', 'rank'], "
        "['model', 'rank'] in metrics_names.py",
    ]


PAGE = """\
# HELP hookprof_steps_total Training steps completed
# TYPE hookprof_steps_total counter
hookprof_steps_total{model="Net",rank="0"} 3.0
# HELP hookprof_layer_forward_seconds Forward time
# TYPE hookprof_layer_forward_seconds summary
hookprof_layer_forward_seconds_count{layer="fc",model="Net",module="Linear",rank="0"} 3.0
hookprof_layer_forward_seconds_sum{layer="fc",model="Net",module="Linear",rank="0"} 0.1
# HELP hookprof_layer_recompute_seconds Recomputation
# TYPE hookprof_layer_recompute_seconds summary
# HELP hookprof_gpu_power_watts GPU power draw (NVML)
# TYPE hookprof_gpu_power_watts gauge
hookprof_gpu_power_watts{UUID="GPU-1",gpu="0"} 300.0
"""
PAGE_DOCS = """\
| metric | type | labels | present | meaning |
|---|---|---|---|---|
| `hookprof_steps_total` | counter | `model`, `rank` | always | steps |
| `hookprof_layer_forward_seconds` | summary | `model`, `rank`, `layer`, `module` | always | time |
| `hookprof_layer_recompute_seconds` | summary | `model`, `rank`, `layer` | checkpointing | time |
| `hookprof_gpu_power_watts` | gauge | `gpu`, `UUID` | **GPU only**: NVML | watts |
| `hookprof_gpu_energy_joules_total` | counter | `gpu`, `UUID` | **GPU only**: NVML | joules |
"""


def test_a_page_and_docs_that_agree_give_nothing():
    # _total put back on the counter; _sum/_count folded into the summary; a family without
    # samples has no labels to compare; a GPU-only row may be absent, may be present
    assert (
        disagreements(
            documented(PAGE_DOCS), exported(PAGE), "the page", gpu_rows_may_be_absent=True
        )
        == []
    )


def test_a_series_on_the_page_the_docs_lack_is_reported():
    docs = documented(
        PAGE_DOCS.replace(
            "| `hookprof_steps_total` | counter | `model`, `rank` | always | steps |\n", ""
        )
    )
    assert disagreements(docs, exported(PAGE), "the page", gpu_rows_may_be_absent=True) == [
        "hookprof_steps_total: in the page, not documented"
    ]


def test_a_documented_series_missing_from_the_page_is_reported_unless_gpu_only():
    page = PAGE.replace('hookprof_steps_total{model="Net",rank="0"} 3.0\n', "").replace(
        "# HELP hookprof_steps_total Training steps completed\n# TYPE hookprof_steps_total counter\n",
        "",
    )
    assert disagreements(
        documented(PAGE_DOCS), exported(page), "the page", gpu_rows_may_be_absent=True
    ) == ["hookprof_steps_total: documented, not in the page"]
    assert disagreements(documented(PAGE_DOCS), exported(PAGE), "the page") == [
        "hookprof_gpu_energy_joules_total: documented, not in the page"
    ]


def test_labels_on_the_page_that_the_docs_lack_are_reported():
    page = PAGE.replace('{UUID="GPU-1",gpu="0"}', '{UUID="GPU-1",gpu="0",model="Net"}')
    assert disagreements(documented(PAGE_DOCS), exported(page), "the page") == [
        "hookprof_gpu_energy_joules_total: documented, not in the page",
        "hookprof_gpu_power_watts: documented labels ['UUID', 'gpu'], ['UUID', 'gpu', 'model'] in the page",
    ]
