"""Real Prometheus and Alertmanager (Debian's packages) on loopback for tests: started with
short intervals, waited for with bounded polls, and always stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from support.binaries import require_binaries
from support.paths import RULES
from support.ports import free_port, free_port_range
from support.processes import Processes
from support.waiting import wait_for


def binaries() -> dict[str, str]:
    """Prometheus and Alertmanager; the calling test is skipped where they are missing."""
    prometheus, alertmanager = require_binaries("prometheus", "prometheus-alertmanager")
    return {"prometheus": prometheus, "alertmanager": alertmanager}


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Webhook:
    """Alertmanager's webhook receiver: records every notification with its arrival time."""

    def __init__(self):
        self.received: list[tuple[float, dict]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((time.monotonic(), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, status: str = "firing") -> list[tuple[float, dict]]:
        return [
            (t, a) for t, n in self.received for a in n.get("alerts", []) if a["status"] == status
        ]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def start_alertmanager(procs: Processes, tmp: str, webhook_port: int) -> int:
    port = free_port()
    config = os.path.join(tmp, "am.yml")
    with open(config, "w") as f:
        f.write(f"""
route:
  receiver: webhook
  group_by: ['alertname', 'rank', 'phase']
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: webhook
    webhook_configs:
      - url: http://127.0.0.1:{webhook_port}/
        send_resolved: true
""")
    procs.start(
        [
            binaries()["alertmanager"],
            f"--config.file={config}",
            f"--storage.path={os.path.join(tmp, 'am')}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ]
    )
    wait_for(
        "alertmanager ready",
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200,
        timeout=30,
    )
    return port


def start_prometheus(
    procs: Processes, tmp: str, targets: list[str], am_port: int | None, job: str = "hookprof"
) -> int:
    port = free_port()
    config = os.path.join(tmp, "prom.yml")
    alerting = (
        ""
        if am_port is None
        else f"""
alerting:
  alertmanagers:
    - static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]"""
    )
    with open(config, "w") as f:
        f.write(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ['{RULES}']{alerting}
scrape_configs:
  - job_name: {job}
    static_configs: [{{targets: {json.dumps(targets)}}}]
""")
    procs.start(
        [
            binaries()["prometheus"],
            f"--config.file={config}",
            f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
    )
    wait_for(
        "prometheus ready",
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200,
        timeout=30,
    )
    return port


def query(prom_port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=" + urllib.parse.quote(expr)
    return get_json(url)["data"]["result"]


@contextlib.contextmanager
def ranks_scraped(run_rank, args_of_rank, world: int, tmp: str, job: str, scrapes: int):
    """`world` spawned ranks of a torch.distributed job (rank r runs
    `run_rank(r, world, master_port, base_port, *args_of_rank(r, out, go_home))` and puts
    (rank, url) on `out` once it serves), scraped by a real Prometheus as `job`. Yields
    (Prometheus port, the workers) once every rank was scraped `scrapes` times; the ranks are
    told to go home, Prometheus is stopped and the workers joined (or killed) whatever happens."""
    import torch.multiprocessing as mp

    from support.ranks import join_or_kill

    ctx = mp.get_context("spawn")
    out, go_home = ctx.Queue(), ctx.Event()
    master_port = free_port()
    base_port = free_port_range(world, avoid=(master_port,))
    workers = [
        ctx.Process(
            target=run_rank, args=(r, world, master_port, base_port, *args_of_rank(r, out, go_home))
        )
        for r in range(world)
    ]
    procs = Processes()
    for w in workers:
        w.start()
    try:
        urls = dict(out.get(timeout=60) for _ in range(world))
        assert urls[world - 1].endswith(f":{base_port + world - 1}/metrics")
        prom = start_prometheus(
            procs, tmp, [f"127.0.0.1:{base_port + r}" for r in range(world)], None, job=job
        )
        wait_for(
            f"every rank scraped {scrapes} times",
            lambda: (
                len(
                    query(
                        prom,
                        f'count_over_time(hookprof_steps_total{{job="{job}"}}[1m]) >= {scrapes}',
                    )
                )
                == world
            ),
            timeout=40,
        )
        yield prom, workers
    finally:
        go_home.set()
        procs.stop_all()
        join_or_kill(workers)
