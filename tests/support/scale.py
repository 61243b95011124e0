"""A job of simulated ranks (support/farm.py) scraped by a real Prometheus configured by
deploy/scale/prometheus.yml (hookprof's rules, remote_write of the aggregates) into a real
VictoriaMetrics: what bench/scale_farm.py measures and tests/system/test_scale_farm.py
checks at a small size. Every server binds 127.0.0.1 and is stopped by PID however the run
ends."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import yaml

from support.binaries import require_binaries
from support.farm import Farm, Slowdown
from support.paths import ROOT, RULES
from support.ports import free_port
from support.processes import Processes
from support.waiting import wait_for

CONFIG = os.path.join(ROOT, "deploy", "scale", "prometheus.yml")
STORE_FLAGS = os.path.join(ROOT, "deploy", "scale", "victoria-metrics.args")
JOB = "hookprof"


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class ScaleRun:
    """The servers of one run: ports, and Prometheus's PID (its memory is read from /proc)."""

    farm: Farm
    prom_port: int
    vm_port: int
    prom_pid: int

    def query(self, expr: str, port: int | None = None) -> list[dict]:
        port = self.prom_port if port is None else port
        url = f"http://127.0.0.1:{port}/api/v1/query?query=" + urllib.parse.quote(expr)
        return get_json(url)["data"]["result"]

    def value(self, expr: str) -> float | None:
        found = self.query(expr)
        return float(found[0]["value"][1]) if found else None

    def _own_samples(self) -> list:
        """The samples of Prometheus's own /metrics page."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}/metrics", timeout=10) as r:
            page = r.read().decode()
        return [s for family in text_string_to_metric_families(page) for s in family.samples]

    def own(self, name: str, **labels: str) -> float:
        """The sum of Prometheus's own metric `name` over its series whose labels include
        `labels`."""
        return sum(
            s.value
            for s in self._own_samples()
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def rule_group_seconds(self, group: str | None = None) -> float:
        """The last evaluation's duration of hookprof's rule group `group` (all: None)."""
        return sum(
            s.value
            for s in self._own_samples()
            if s.name == "prometheus_rule_group_last_duration_seconds"
            and (group is None or s.labels.get("rule_group", "").endswith(";" + group))
        )

    def prometheus_rss_bytes(self) -> int:
        with open(f"/proc/{self.prom_pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def store_series(self) -> int:
        """Series the long-term store holds (VictoriaMetrics' count of all)."""
        return int(get_json(f"http://127.0.0.1:{self.vm_port}/api/v1/series/count")["data"][0])

    def store_names(self) -> list[str]:
        url = f"http://127.0.0.1:{self.vm_port}/api/v1/label/__name__/values"
        return sorted(get_json(url)["data"])

    def firing(self, alertname: str) -> list[dict]:
        alerts = get_json(f"http://127.0.0.1:{self.prom_port}/api/v1/alerts")["data"]["alerts"]
        return [
            a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        ]


def store_flags(port: int, path: str) -> list[str]:
    """deploy/scale/victoria-metrics.args, its address and storage path this run's."""
    with open(STORE_FLAGS) as f:
        flags = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    where = {"-httpListenAddr": f"127.0.0.1:{port}", "-storageDataPath": path}
    return [
        f"{flag.split('=')[0]}={where[flag.split('=')[0]]}" if flag.split("=")[0] in where else flag
        for flag in flags
    ]


def prometheus_config(targets_file: str, store_url: str, interval: str) -> str:
    """deploy/scale/prometheus.yml, its two REPLACE places filled (and the rules file's path
    made absolute: the config is written elsewhere), at `interval`."""
    with open(CONFIG) as f:
        config = yaml.safe_load(f)
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = interval
    config["global"]["scrape_timeout"] = interval
    config["rule_files"] = [RULES]
    config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [targets_file]
    config["remote_write"][0]["url"] = store_url
    return yaml.safe_dump(config, sort_keys=False)


def _wait_ready(what: str, url: str) -> None:
    wait_for(
        f"{what} ready",
        lambda: urllib.request.urlopen(url, timeout=2).status == 200,
        timeout=30,
    )


@contextlib.contextmanager
def scale_run(
    tmp: str,
    ranks: int,
    layers: int,
    *,
    interval: str = "5s",
    slowdown: Slowdown | None = None,
    calls_per_s: float = 0.5,
    detailed: int | None = None,
) -> Iterator[ScaleRun]:
    """`ranks` simulated ranks of `layers` layers scraped every `interval` (see the module's
    docstring), `detailed` of them with every figure (Farm); yields once Prometheus has
    scraped every rank."""
    prometheus, vm = require_binaries("prometheus", "victoria-metrics")
    farm = Farm(ranks, layers, slowdown=slowdown, calls_per_s=calls_per_s, detailed=detailed)
    procs = Processes()
    try:
        farm_port = farm.serve()
        targets = os.path.join(tmp, "targets.json")
        with open(targets, "w") as f:
            json.dump(farm.scrape_configs(farm_port, JOB), f)
        vm_port = free_port()
        procs.start([vm, *store_flags(vm_port, os.path.join(tmp, "vm"))])
        _wait_ready("victoria-metrics", f"http://127.0.0.1:{vm_port}/health")
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write(
                prometheus_config(targets, f"http://127.0.0.1:{vm_port}/api/v1/write", interval)
            )
        prom_port = free_port()
        proc = procs.start(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ]
        )
        run = ScaleRun(farm, prom_port, vm_port, proc.pid)
        _wait_ready("prometheus", f"http://127.0.0.1:{prom_port}/-/ready")
        wait_for(
            f"all {ranks} simulated ranks scraped",
            lambda: run.value(f'count(up{{job="{JOB}"}} == 1)') == ranks,
            timeout=120,
        )
        yield run
    finally:
        procs.stop_all()
        farm.close()
