"""deploy/: the compose stack and the Kubernetes manifests, validated offline with the real
tools (no Docker engine or cluster here): docker-compose config, promtool, amtool, and
cross-checks that the files agree with each other. The example torchrun script runs for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from support.binaries import require_binaries
from support.metrics import parse, samples, scrape
from support.paths import ROOT

COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
COMPOSE = os.path.join(COMPOSE_DIR, "docker-compose.yml")
K8S = os.path.join(ROOT, "deploy", "kubernetes")


def tool(name: str) -> str:
    return require_binaries(name)[0]


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)


def compose() -> dict:
    with open(COMPOSE, encoding="utf-8") as f:
        return yaml.safe_load(f)


def mounts(service: str) -> dict[str, str]:
    """container path -> host path (absolute) of a service's bind mounts."""
    out = {}
    for volume in compose()["services"][service]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = os.path.normpath(os.path.join(COMPOSE_DIR, source))
    return out


def rule_count() -> int:
    with open(
        os.path.join(ROOT, "deploy", "prometheus", "hookprof-rules.yml"), encoding="utf-8"
    ) as f:
        return sum(len(g["rules"]) for g in yaml.safe_load(f)["groups"])


def flag(service: str, name: str) -> str:
    (value,) = [
        a.split("=", 1)[1]
        for a in compose()["services"][service]["command"]
        if a.startswith(name + "=")
    ]
    return value


# ------------------------------------------------------------------ compose


def test_docker_compose_config_is_valid():
    result = run([tool("docker-compose"), "-f", COMPOSE, "config", "-q"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_as_mounted_in_the_container_passes_promtool(tmp_path):
    # rebuild the container's file layout from the compose file's mounts, then check it
    for target, source in mounts("prometheus").items():
        dest = tmp_path / target.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, dest)
    config = tmp_path / flag("prometheus", "--config.file").lstrip("/")
    result = run([tool("promtool"), "check", "config", str(config)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "1 rule files found" in result.stdout and f"{rule_count()} rules found" in result.stdout
    ), result.stdout
    prom = yaml.safe_load(config.read_text())
    (job,) = prom["scrape_configs"]
    assert "hookprof" in job["job_name"]  # the exporter-down alerts select on it
    targets = json.loads((tmp_path / "etc/prometheus/targets/hookprof.json").read_text())
    assert targets[0]["targets"] == ["127.0.0.1:8479"]  # hookprof's default port
    am = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == [flag("alertmanager", "--web.listen-address")]


def test_alertmanager_config_passes_amtool():
    result = run([tool("amtool"), "check-config", os.path.join(COMPOSE_DIR, "alertmanager.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards():
    grafana = mounts("grafana")
    provisioning = grafana["/etc/grafana/provisioning"]
    with open(os.path.join(provisioning, "datasources", "prometheus.yml"), encoding="utf-8") as f:
        ds = yaml.safe_load(f)
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://" + flag("prometheus", "--web.listen-address")
    with open(os.path.join(provisioning, "dashboards", "hookprof.yml"), encoding="utf-8") as f:
        providers = yaml.safe_load(f)
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    dashboards_dir = grafana[provider["options"]["path"]]
    assert dashboards_dir == os.path.join(ROOT, "grafana", "dashboards")
    home = compose()["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert os.path.exists(os.path.join(dashboards_dir, os.path.basename(home)))


def test_every_server_listens_on_loopback_only():
    for service in ("prometheus", "alertmanager"):
        assert flag(service, "--web.listen-address").startswith("127.0.0.1:"), service
    assert compose()["services"]["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"


# ------------------------------------------------------------------ kubernetes

EXPECTED_KINDS = {
    "podmonitor.yaml": ("monitoring.coreos.com/v1", "PodMonitor"),
    "prometheusrule.yaml": ("monitoring.coreos.com/v1", "PrometheusRule"),
    "grafana-dashboards.yaml": ("v1", "ConfigMap"),
    "train-script.yaml": ("v1", "ConfigMap"),
    "training-job.yaml": ("batch/v1", "Job"),
}


def manifest(name: str) -> dict:
    with open(os.path.join(K8S, name), encoding="utf-8") as f:
        (doc,) = list(yaml.safe_load_all(f))
    return doc


def test_every_manifest_parses_with_the_right_kind_and_api_version():
    files = sorted(f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml")))
    assert files == sorted(EXPECTED_KINDS)
    for name, (api, kind) in EXPECTED_KINDS.items():
        doc = manifest(name)
        assert (doc["apiVersion"], doc["kind"]) == (api, kind), name
        assert doc["metadata"]["name"], name


def test_generated_manifests_are_up_to_date():
    result = run([sys.executable, os.path.join(K8S, "generate.py"), "--check"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_generator_check_refuses_a_promtool_test_file_in_the_rules_glob(tmp_path):
    # a copy of the repository's deploy/ and dashboards, with a unit-test file put back where
    # it was before issue 32: the rules' glob must hold rule files only
    shutil.copytree(os.path.join(ROOT, "deploy"), tmp_path / "deploy")
    shutil.copytree(
        os.path.join(ROOT, "grafana", "dashboards"), tmp_path / "grafana" / "dashboards"
    )
    shutil.copy(
        tmp_path / "deploy/prometheus/tests/hookprof-rules.test.yml", tmp_path / "deploy/prometheus"
    )
    result = run([sys.executable, str(tmp_path / "deploy/kubernetes/generate.py"), "--check"])
    assert result.returncode == 1
    assert "deploy/prometheus/hookprof-rules.test.yml is in the rules' glob" in result.stderr


def test_prometheusrule_groups_pass_promtool(tmp_path):
    rule = manifest("prometheusrule.yaml")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = run([tool("promtool"), "check", "rules", str(path)])
    assert result.returncode == 0 and f"{rule_count()} rules found" in result.stdout, (
        result.stdout + result.stderr
    )


def test_podmonitor_selects_the_job_and_covers_its_ports():
    monitor, job = manifest("podmonitor.yaml"), manifest("training-job.yaml")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    endpoints = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert endpoints == [f"hookprof-{i}" for i in range(8)]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    base = int(env["HOOKPROF_PORT"])
    assert env["HOOKPROF_ADDR"] == "0.0.0.0"
    nproc = int(
        next(a for a in container["command"] if a.startswith("--nproc-per-node=")).split("=")[1]
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # one named port per local rank, rank N on base + N, each one the PodMonitor scrapes
    assert ports == {f"hookprof-{i}": base + i for i in range(nproc)}
    assert all(len(n) <= 15 for n in ports)  # Kubernetes' limit on port names
    assert set(ports) <= set(endpoints)


def test_configmaps_carry_the_dashboards_and_the_script_the_job_mounts():
    dashboards = manifest("grafana-dashboards.yaml")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    with open(
        os.path.join(ROOT, "grafana", "dashboards", "hookprof-training.json"), encoding="utf-8"
    ) as f:
        assert json.loads(dashboards["data"]["hookprof-training.json"]) == json.load(f)
    job = manifest("training-job.yaml")
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    script = manifest("train-script.yaml")
    assert volumes["train-script"]["configMap"]["name"] == script["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "train-script")
    script_arg = next(a for a in container["command"] if a.endswith(".py"))
    assert os.path.dirname(script_arg) == mount["mountPath"]
    assert os.path.basename(script_arg) in script["data"]


@pytest.mark.slow
def test_the_example_torchrun_script_trains_and_every_rank_serves_metrics():
    """Two local ranks: gloo on the CPU without GPUs, and also on a node with fewer GPUs than
    ranks, which the script says once."""
    output = run_train_script(nproc=2, layers=3)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    short = "GPU(s) for 2 local ranks: training on the CPU with gloo"
    assert output.count(short) == (1 if 0 < gpus < 2 else 0), output


@pytest.mark.slow
@pytest.mark.cuda
def test_the_example_torchrun_script_with_one_gpu_per_rank():
    """As in the Job: one GPU per local rank, NCCL."""
    output = run_train_script(nproc=torch.cuda.device_count(), layers=3)
    assert "training on the CPU" not in output


def run_train_script(nproc: int, layers: int) -> str:
    """Run deploy/kubernetes/train.py under torchrun until every rank has served 5 steps with
    `layers` gradient norms; returns what the ranks printed."""
    from support.ports import free_port_range

    base = free_port_range(nproc)
    env = {
        **os.environ,
        "HOOKPROF_PORT": str(base),
        "HOOKPROF_SAMPLE_EVERY": "1",
        "HOOKPROF_MIN_SAMPLE_INTERVAL_S": "0",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            os.path.join(K8S, "train.py"),
            "--steps",
            "100000",
            "--width",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        urls, output = {}, ""
        deadline = time.monotonic() + 120
        while len(urls) < nproc and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            output += line  # ranks share the pipe: their lines can run together
            urls = dict(re.findall(r"rank (\d+): metrics at (http://\S+?/metrics)", output))
        assert set(urls) == {str(r) for r in range(nproc)}, output
        for rank, url in urls.items():
            assert url.endswith(f":{base + int(rank)}/metrics")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                f = parse(scrape(url))
                steps = samples(f, "hookprof_steps", "hookprof_steps_total")
                if steps and list(steps.values())[0] >= 5:
                    break
                time.sleep(0.2)
            assert steps == {
                frozenset({"rank": rank}.items()): steps[frozenset({"rank": rank}.items())]
            }
            assert len(samples(f, "hookprof_layer_gradient_norm")) == layers
        return output
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
