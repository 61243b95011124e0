"""Every PromQL expression of the shipped dashboard and alert rules, run against a real
Prometheus (Debian's) scraping a real `hookprof demo` on loopback. NVML and torch.cuda are
stand-ins in that demo (tests/workers/fake_gpu_demo.py): CI has no GPU, and the GPU panels must
still be shown to return data. A query that returns nothing is named in the failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.parse

import pytest

from support.dashboard import JOB, alert_rules, dashboard, panel_queries, substitute
from support.paths import ROOT, worker
from support.ports import free_port
from support.processes import Processes, read_until
from support.servers import binaries, get_json, query, start_prometheus
from support.waiting import wait_for

# exported only while a rank is stalled (the demo never stalls:
# tests/system/test_stall_distributed.py runs those rules against real stalls), or after a
# loss or gradient-norm spike (the demo has none: tests/behaviour/test_spikes.py scrapes it
# after real ones, and promtool's tests run HookprofTrainingSpike on it), or after a replay
# check that did not reproduce (tests/behaviour/test_replay_check.py makes one)
EXPORTED_ONLY_SOMETIMES = {
    "hookprof_stall_info",
    "hookprof_spike_last_step",
    "hookprof_replay_mismatch_info",
    "hookprof_parameter_change_info",  # (a change only: tests/system/test_replica_check_ranks.py)
    "hookprof_parameter_change_timestamp_seconds",
    "hookprof_replay_mismatch_timestamp_seconds",
    "hookprof_spike_mismatch_info",  # (a spike's replay that did not reproduce:
    "hookprof_spike_mismatch_timestamp_seconds",  # tests/behaviour/test_spike_replay.py)
}


@pytest.fixture(scope="module")
def prometheus_on_demo(tmp_path_factory):
    binaries()  # skips where Prometheus is not installed
    tmp = str(tmp_path_factory.mktemp("dash"))
    procs = Processes()
    try:
        port = free_port()
        demo = procs.start(
            [
                sys.executable,
                worker("fake_gpu_demo.py"),
                "demo",
                "--port",
                str(port),
                "--nan-at-step",
                "150",
                "--nan-layer",
                "mlp.2",
                "--step-delay",
                "0.01",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "HOOKPROF_SYSTEM_INTERVAL_S": "0.5",
                "HOOKPROF_MIN_SAMPLE_INTERVAL_S": "0.5",
                # a CPU has no default peak: a set one makes the MFU panel's series exist
                "HOOKPROF_PEAK_FLOPS": "1e12",
                # the replica and replay checks' series (their rules read them)
                "HOOKPROF_SDC_CHECK_INTERVAL_S": "1",
                # the spike replay's counter (HookprofSpikeNotReproduced reads it)
                "HOOKPROF_SPIKE_REPLAY": "1",
            },
        )
        read_until(demo.stdout, "serving metrics")
        prom = start_prometheus(procs, tmp, [f"127.0.0.1:{port}"], None, job=JOB)
        # enough history for rate() windows, and the NaN localised and scraped
        wait_for(
            "the first non-finite layer in Prometheus",
            lambda: query(prom, "hookprof_first_nonfinite_info"),
            timeout=90,
        )
        wait_for(
            "10 scrapes",
            lambda: query(prom, f'count_over_time(up{{job="{JOB}"}}[1m]) >= 10'),
            timeout=60,
        )
        yield prom
    finally:
        procs.stop_all()


def test_every_panel_query_returns_data(prometheus_on_demo):
    queries = panel_queries(dashboard())
    assert len(queries) >= 25
    empty = []
    for title, expr in queries:
        result = query(prometheus_on_demo, substitute(expr))  # a bad query raises (HTTP 400)
        if not result:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries that returned no data:\n" + "\n".join(empty)


def test_the_first_nonfinite_table_names_the_injected_layer(prometheus_on_demo):
    (expr,) = [e for t, e in panel_queries(dashboard()) if t == "First non-finite layer"]
    (row,) = query(prometheus_on_demo, substitute(expr))
    assert row["metric"]["layer"] == "mlp.2" and row["metric"]["phase"] == "forward"
    assert row["metric"]["step"] == "150" and row["metric"]["model"] == "DemoNet"


def test_every_variable_query_lists_values(prometheus_on_demo):
    expected = {"job": {JOB}, "rank": {"0"}, "model": {"DemoNet"}}
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        selector, label = substitute(m.group(1)), m.group(2)
        url = (
            f"http://127.0.0.1:{prometheus_on_demo}/api/v1/label/{label}/values?"
            + urllib.parse.urlencode({"match[]": selector})
        )
        values = set(get_json(url)["data"])
        assert values, f"variable {var['name']} lists nothing: {var['query']['query']}"
        if var["name"] in expected:
            assert values == expected[var["name"]], (var["name"], values)
        if var["name"] == "layer":
            assert {"mlp.0", "mlp.2"} <= values


# per process and host: never a `model` label (issue 18); every other hookprof_* series has one
PER_PROCESS = (
    "hookprof_(host|gpu|cuda_memory)_.*|hookprof_build_info"
    "|hookprof_http_connections_rejected_total"
)


def test_per_process_series_carry_no_model_label(prometheus_on_demo):
    wrong = query(
        prometheus_on_demo,
        f'group by (__name__) ({{job="{JOB}", __name__=~"process_.*|{PER_PROCESS}", model!=""}})',
    )
    assert not wrong, [r["metric"]["__name__"] for r in wrong]


def test_every_per_model_series_carries_the_model_label(prometheus_on_demo):
    unlabelled = query(
        prometheus_on_demo,
        f'group by (__name__) ({{job="{JOB}", __name__=~"hookprof_.*", '
        f'__name__!~"{PER_PROCESS}", model=""}})',
    )
    assert not unlabelled, sorted(r["metric"]["__name__"] for r in unlabelled)
    (var,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "model"]
    m = re.fullmatch(r"label_values\((.+), model\)", var["query"]["query"])
    url = (
        f"http://127.0.0.1:{prometheus_on_demo}/api/v1/label/model/values?"
        + urllib.parse.urlencode({"match[]": substitute(m.group(1))})
    )
    assert len(get_json(url)["data"]) == 1  # the demo attaches one model


def test_every_alert_rule_evaluates_and_its_series_exist(prometheus_on_demo):
    rules = {r.get("alert") or r["record"]: r for r in alert_rules()}
    loaded = wait_for(
        "rules evaluated",
        lambda: (
            [
                r
                for g in get_json(f"http://127.0.0.1:{prometheus_on_demo}/api/v1/rules")["data"][
                    "groups"
                ]
                for r in g["rules"]
                if r.get("lastEvaluation", "").startswith("2")
            ]
            or None
        ),
        timeout=30,
    )
    assert {r["name"] for r in loaded} == set(rules)
    for r in loaded:
        assert r["health"] == "ok" and not r.get("lastError"), (r["name"], r.get("lastError"))
    # an alert's expression is empty while it does not fire: check the series it reads
    missing = []
    for name, rule in rules.items():
        for metric in (
            set(re.findall(r"\b(hookprof_\w+|up)\b", rule["expr"])) - EXPORTED_ONLY_SOMETIMES
        ):
            if not query(prometheus_on_demo, f'{metric}{{job="{JOB}"}}'):
                missing.append(f"{name}: {metric}")
    assert not missing, "alert rules read series that do not exist:\n" + "\n".join(missing)
    # and the NaN injected in the demo makes the non-finite alert's expression return data
    nonfinite = [r for r in rules.values() if "first_nonfinite_info" in r["expr"]]
    assert nonfinite and all(query(prometheus_on_demo, r["expr"]) for r in nonfinite)


def readme_recording_rules() -> list[dict]:
    """The recording rules docs/scale.md (linked from the README) recommends."""
    import yaml

    with open(os.path.join(ROOT, "docs", "scale.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if "record:" in b]
    return yaml.safe_load(textwrap.dedent(block))


def test_readme_recording_rules_pass_promtool_and_return_data(prometheus_on_demo, tmp_path):
    from support.binaries import promtool

    doc = readme_recording_rules()
    path = tmp_path / "recording.yml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    tool = promtool()
    if tool is not None:
        result = subprocess.run(
            [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert len(rules) >= 4
    empty = [r["record"] for r in rules if not query(prometheus_on_demo, r["expr"])]
    assert not empty, f"recording rules that return no data: {empty}"
