"""The committed dashboard JSON: regenerated from grafana/generate.py it is identical, and it
holds together the way Grafana needs on first import (a datasource variable used by every
query, the variables the issue names, per-layer panels bounded by $topk)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.dashboard import dashboard
from support.paths import ROOT


@pytest.fixture(scope="module")
def board() -> dict:
    return dashboard()


def test_committed_json_is_what_the_generator_writes():
    pytest.importorskip("grafana_foundation_sdk")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "grafana", "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_variables_and_datasource(board):
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "job", "model", "instance", "rank", "layer", "topk"} <= set(variables)
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("job", "model", "instance", "rank", "layer"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*", (
            name
        )
        assert v["datasource"]["uid"] == "${datasource}", name
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", panel["title"]


def test_panels_the_issue_asks_for(board):
    titles = {p["title"]: p for p in board["panels"]}
    for title, kind in {
        "Steps per second": "timeseries",
        "Step duration": "timeseries",
        "Loss": "timeseries",
        "Global gradient norm": "timeseries",
        "Top layers by forward time": "bargauge",
        "Top layers by backward time": "bargauge",
        "Forward latency per layer": "timeseries",
        "Backward latency per layer": "timeseries",
        "Gradient norm per layer": "timeseries",
        "First non-finite layer": "table",
        "GradScaler skipped steps": "timeseries",
        "CPU": "timeseries",
        "Memory": "timeseries",
        "GPU utilisation": "timeseries",
        "GPU memory": "timeseries",
        "GPU power and temperature": "timeseries",
        "Scrape targets up": "timeseries",
        # issue 15
        "Model FLOP/s": "timeseries",
        "Model FLOPs utilisation (MFU)": "timeseries",
        "Achieved FLOP/s of the slowest layers": "bargauge",
        "Update-to-weight ratio": "timeseries",
        "Update-to-weight ratio per layer": "timeseries",
        "Step time per rank and the median of ranks": "timeseries",
        "Slowest rank over the median": "timeseries",
        "Step phases per rank over the median of ranks": "timeseries",
        "Step time by phase": "timeseries",
        "Device time by phase (CUDA)": "timeseries",
    }.items():
        assert titles[title]["type"] == kind, title


def test_per_layer_panels_are_bounded_for_1000_layers(board):
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"]
            if "hookprof_layer_" in expr:
                assert expr.startswith("topk($topk,"), (panel["title"], expr)
                assert 'layer=~"$layer"' in expr, (panel["title"], expr)


# per attached model (they carry `model`) or per process and host (they do not): issue 18
PER_MODEL = re.compile(
    r"\bhookprof_(?:steps|sampled_steps|step_duration_seconds|last_step_timestamp_seconds|loss"
    r"|gradient_norm|nonfinite_steps|skipped_steps|gradient_flagged_steps|layer_\w+"
    r"|first_nonfinite_info|layers|layers_exported|internal_errors|publisher_thread_up"
    r"|model_flops_\w+|update_ratio|step_phase_seconds|step_phase_device_seconds|progress_\w+|stalled|stalls|stall_info"
    r"|spikes|parameter_changes_outside_update|replay_checks)"
    r"|\bhookprof:layer_\w+:\w+"  # the layer stragglers' recording rules keep `model` (issue 42)
)
PER_PROCESS = re.compile(
    r"\b(?:up|process_\w+|hookprof_(?:host|gpu|cuda_memory)_\w+"
    r"|hookprof_http_connections_rejected_total|hookprof_build_info)\b"
)


def test_model_variable_selects_every_per_model_query_and_keeps_models_apart(board):
    variables = [v["name"] for v in board["templating"]["list"]]
    assert variables.index("job") < variables.index("model") < variables.index("layer")
    (model,) = [v for v in board["templating"]["list"] if v["name"] == "model"]
    assert model["query"]["query"] == 'label_values(hookprof_steps_total{job=~"$job"}, model)'
    # the variables after it are narrowed by it
    for v in board["templating"]["list"][variables.index("model") + 1 :]:
        if v["type"] == "query":
            assert 'model=~"$model"' in v["query"]["query"], v["name"]
    per_model = 0
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            expr, legend = t["expr"], t.get("legendFormat", "")
            if PER_MODEL.search(expr):
                per_model += 1
                # every selector of a per-model metric filters on the variable
                for selector in re.findall(r"\bhookprof[_:][\w:]+(\{[^}]*\})?", expr):
                    assert 'model=~"$model"' in selector, (panel["title"], expr)
                # aggregations keep the model, and legends name it, so G and D stay apart
                for by in re.findall(r"\bby \(([^)]*)\)", expr):
                    assert "model" in [x.strip() for x in by.split(",")], (panel["title"], expr)
                assert panel["type"] == "table" or "{{model}}" in legend, (panel["title"], legend)
            elif PER_PROCESS.search(expr):
                assert "model" not in expr and "{{model}}" not in legend, (panel["title"], expr)
            else:
                raise AssertionError(f"{panel['title']}: neither per model nor per process: {expr}")
    assert per_model >= 20
    (table_panel,) = [p for p in board["panels"] if p["title"] == "First non-finite layer"]
    (organize,) = table_panel["transformations"]
    assert organize["options"]["indexByName"]["model"] == 0


def test_layout_has_no_overlapping_panels(board):
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
