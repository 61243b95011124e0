"""hookprof/metrics_names.py: every name follows Prometheus's naming rules (promtool's lint
too), the module stands alone, and no other module of hookprof spells a metric name itself."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hookprof
from hookprof import metrics_names
from hookprof.metrics_names import ALL, Metric, family
from support.binaries import promtool

PACKAGE = Path(hookprof.__file__).parent
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
BASE_UNITS = {"seconds", "bytes", "ratio", "watts", "celsius", "joules"}
# units Prometheus wants written in base units (seconds, bytes, ratio 0-1)
NOT_BASE_UNITS = {
    "ms",
    "us",
    "ns",
    "millis",
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kb",
    "mb",
    "gb",
    "kib",
    "mib",
    "gib",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "percent",
    "pct",
    "fahrenheit",
    "kelvin",
}


def test_every_name_follows_prometheus_naming():
    for m in ALL:
        assert NAME.fullmatch(m.name), m.name
        assert m.name.startswith(("hookprof_", "process_")), m.name
        assert m.kind in ("counter", "gauge", "summary", "histogram"), m
        # counters, and only counters, end in _total
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        words = m.name.removesuffix("_total").split("_")
        assert not set(words) & NOT_BASE_UNITS, m.name
        # a unit is the name's last word (before _total)
        assert all(w == words[-1] for w in words if w in BASE_UNITS), m.name
        # an info metric is a gauge of value 1 with the information in its labels
        assert not m.name.endswith("_info") or (m.kind == "gauge" and m.labels), m.name
        for label in m.exported_labels:
            assert LABEL.fullmatch(label) and not label.startswith("__"), (m.name, label)
        assert not set(m.exported_labels) & {"le", "quantile"}, m.name
        assert len(set(m.exported_labels)) == len(m.exported_labels), m.name
        assert m.help.strip(), m.name


def test_names_and_help_texts_are_each_defined_once():
    assert len({m.name for m in ALL}) == len(ALL)
    assert len({m.family_name for m in ALL}) == len(ALL)
    assert len({m.help for m in ALL}) == len(ALL)
    # each constant is named after its series, so a reader finds one from the other
    for constant, value in vars(metrics_names).items():
        if isinstance(value, Metric):
            assert constant == value.name.removeprefix(metrics_names.PREFIX).upper(), constant


def test_promtool_accepts_every_name_with_a_sample_each():
    class Every:
        def collect(self):
            for m in ALL:
                made = family(m)
                values = [f"v{i}" for i in range(len(m.labels))]
                if m.kind == "summary":
                    made.add_metric(values, 1, 0.5)
                elif m.kind == "histogram":
                    made.add_metric(values, [("1.0", 1), ("+Inf", 1)], 0.5)
                else:
                    made.add_metric(values, 1)
                yield made

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Every())
    text = generate_latest(registry).decode()
    result = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""
    # what family() built is what the module says, as a scraper reads it back
    read = {f.name: f for f in text_string_to_metric_families(text)}
    for m in ALL:
        assert (read[m.family_name].type, read[m.family_name].documentation) == (m.kind, m.help)
        assert {k for s in read[m.family_name].samples for k in s.labels} - {
            "le",
            "quantile",
        } == set(m.labels)


def test_a_metric_without_labels_takes_its_value():
    made = family(metrics_names.HOST_MEMORY_TOTAL_BYTES, 1024)
    assert [(s.name, s.labels, s.value) for s in made.samples] == [
        ("hookprof_host_memory_total_bytes", {}, 1024)
    ]


def test_sample_names_of_summaries_and_histograms():
    assert metrics_names.LAYER_FORWARD_SECONDS.sample("sum") == "hookprof_layer_forward_seconds_sum"
    assert (
        metrics_names.STEP_DURATION_SECONDS.sample("bucket")
        == "hookprof_step_duration_seconds_bucket"
    )
    assert metrics_names.STEPS_TOTAL.family_name == "hookprof_steps"
    assert metrics_names.STEPS_TOTAL.exported_labels == ("model", "rank")
    assert metrics_names.BUILD_INFO.exported_labels == ("version", "torch_version")


def test_the_module_imports_nothing_of_hookprof():
    imported = []
    for node in ast.walk(ast.parse((PACKAGE / "metrics_names.py").read_text())):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # a relative import is one of hookprof's
            imported.append("hookprof" if node.level else node.module)
    assert imported and not [m for m in imported if m.split(".")[0] == "hookprof"], imported


def spelled_names(source: str) -> list[str]:
    """String constants in `source` that spell a metric's name (as a query, a family or a
    sample names it), and f-string pieces that start one."""
    spellings = {
        s
        for m in ALL
        for s in (m.name, m.family_name, *(m.sample(p) for p in ("sum", "count", "bucket")))
    }
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            found += [
                v.value
                for v in node.values
                if isinstance(v, ast.Constant)
                and isinstance(v.value, str)
                and v.value.startswith(("hookprof_", "process_"))
            ]
        elif isinstance(node, ast.Constant) and node.value in spellings:
            found.append(node.value)
    return found


def test_no_other_module_spells_a_metric_name():
    spelled = {
        str(path.relative_to(PACKAGE)): spelled_names(path.read_text())
        for path in PACKAGE.rglob("*.py")
        if path.name != "metrics_names.py"
    }
    assert {path: names for path, names in spelled.items() if names} == {}


def test_the_spelling_check_can_fail():
    assert spelled_names('GaugeMetricFamily("hookprof_loss", "x")') == ["hookprof_loss"]
    assert spelled_names('x = "hookprof_steps"') == ["hookprof_steps"]
    assert spelled_names('x = "hookprof_layer_forward_seconds_sum"') == [
        "hookprof_layer_forward_seconds_sum"
    ]
    assert spelled_names('f"hookprof_gpu_{attr}"') == ["hookprof_gpu_"]
    # prose naming a metric is not a writer or a reader
    assert spelled_names('"""counted by hookprof_steps_total"""') == []
