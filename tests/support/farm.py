"""Simulated ranks for the scale measurement (issue 42 item 3): one process serving the
/metrics pages of many ranks of one job, each rendered by hookprof's own exporter
(`SnapshotCollector`) from a synthetic snapshot that advances with the clock, as a training
rank's does between scrapes.

Each rank has `layers` layers ("blocks.<i>.fc"), every one timed on `calls_per_s` sampled
calls per second, forward and backward, at a per-layer time that differs a little from rank
to rank (a fixed spread of a few percent, so that the median of ranks is a real median); one
rank's one layer can be made slower by `factor` from a moment on (`Slowdown`). Rank r is
served at /rank/<r>/metrics, so one port serves them all; `scrape_config` gives Prometheus
one target per rank, with its own `instance`.

Used by bench/scale_farm.py (the measurement) and tests/system/test_scale_farm.py (the
same path at a small size, in CI)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType

from prometheus_client import generate_latest

from hookprof.metrics_names import LAYER_ACTIVATION_ABS_MAX
from hookprof.publish.recent import RECENT_SAMPLES
from hookprof.serve.exporter import SnapshotCollector, make_registry
from hookprof.snapshot import LayerStatisticValues, LayerStats, Snapshot
from hookprof.step.builtin_statistics import ABS_MAX

MODEL = "GPT"


@dataclass(frozen=True)
class Slowdown:
    """Rank `rank`'s layer `layer` takes `factor` times its time per call in `phase` from
    `after_s` seconds after the farm started."""

    rank: int
    layer: str
    factor: float = 1.4
    phase: str = "forward"
    after_s: float = 0.0


def layer_name(i: int) -> str:
    return f"blocks.{i}.fc"


class Farm:
    """`ranks` simulated ranks of `layers` layers each (see the module's docstring)."""

    def __init__(
        self,
        ranks: int,
        layers: int,
        *,
        slowdown: Slowdown | None = None,
        calls_per_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        detailed: int | None = None,
    ):
        """`detailed`: as Config.detailed_layers, the layers (the first ones) on each page
        with every figure; the others with their time alone (None: all detailed)."""
        self.ranks, self.layers = ranks, layers
        self._detailed = layers if detailed is None else min(detailed, layers)
        self._names = [layer_name(i) for i in range(layers)]
        self._slowdown = slowdown
        self._calls_per_s = calls_per_s
        self._clock = clock
        self._start = clock()
        self.started_at = self._start  # (on `clock`: a slowdown's after_s counts from it)
        self._registries = [
            make_registry(
                SnapshotCollector(
                    partial(self.snapshot, r), "farm", rank=r, model=MODEL, build_info=False
                ),
                process_metrics=False,
            )
            for r in range(ranks)
        ]
        self._server: ThreadingHTTPServer | None = None

    def per_call(self, rank: int, layer: int, phase: str) -> float:
        """Seconds per call of a layer on a rank, before any slowdown: 0.5-2.5 ms by layer,
        times a spread of -3% to +3% by rank (fixed, so scrapes agree with each other)."""
        base = 0.0005 * (1 + layer % 5) * (2.0 if phase == "backward" else 1.0)
        return base * (1 + 0.03 * (((rank * 7 + layer * 13) % 13) - 6) / 6)

    def _seconds(self, rank: int, layer: int, phase: str, calls: int, now: float) -> float:
        per_call = self.per_call(rank, layer, phase)
        slow = self._slowdown
        if (
            slow is None
            or slow.rank != rank
            or slow.layer != self._names[layer]
            or slow.phase != phase
            or now < slow.after_s
        ):
            return calls * per_call
        before = int(slow.after_s * self._calls_per_s)
        return before * per_call + (calls - before) * per_call * slow.factor

    def _median(self, rank: int, layer: int, phase: str, calls: int) -> float | None:
        """The median per call over the last five sampled steps (publish/recent.py), the
        k-th of them at k / calls_per_s seconds; None before there are five."""
        if calls < RECENT_SAMPLES:
            return None
        per_call = self.per_call(rank, layer, phase)
        slow = self._slowdown
        values = sorted(
            per_call * slow.factor
            if slow is not None
            and slow.rank == rank
            and slow.layer == self._names[layer]
            and slow.phase == phase
            and k / self._calls_per_s >= slow.after_s
            else per_call
            for k in range(calls - RECENT_SAMPLES + 1, calls + 1)
        )
        return values[RECENT_SAMPLES // 2]

    def snapshot(self, rank: int) -> Snapshot:
        """Rank `rank` as of now: its counters are those of a rank that has run since the farm
        started (so Prometheus's rate() over them is the per-call time)."""
        now = self._clock() - self._start
        calls = int(now * self._calls_per_s) + 1
        layers = {
            name: LayerStats(
                name,
                "Linear",
                calls=1,
                forward_seconds_total=self._seconds(rank, i, "forward", calls, now),
                forward_calls_total=calls,
                backward_seconds_total=self._seconds(rank, i, "backward", calls, now),
                backward_calls_total=calls,
                forward_seconds_per_call_median=self._median(rank, i, "forward", calls),
                backward_seconds_per_call_median=self._median(rank, i, "backward", calls),
                grad_norm=0.1 + 0.01 * i,
                activation_abs_max=1.0 + 0.1 * i,
            )
            for i, name in enumerate(self._names)
        }
        steps = calls * 10
        detailed = self._names[: self._detailed]
        abs_max = {name: layers[name].activation_abs_max for name in detailed}
        return Snapshot(
            rank=rank,
            step=steps,
            sampled_steps=calls,
            step_duration_buckets=((0.1, steps), (float("inf"), steps)),
            step_duration_sum=steps * 0.05,
            loss=2.0,
            grad_norm=1.0,
            layers=MappingProxyType(layers),
            exported_layers=tuple(detailed),
            timed_layers=tuple(self._names[self._detailed :]),
            # the gauge's source on the page (hookprof's built-in statistics)
            layer_statistics=MappingProxyType(
                {ABS_MAX: LayerStatisticValues(LAYER_ACTIVATION_ABS_MAX.help, abs_max)}
            ),
        )

    def page(self, rank: int) -> bytes:
        return generate_latest(self._registries[rank])

    # ---------------- serving ----------------

    def serve(self) -> int:
        """Serve every rank's page on 127.0.0.1 (a port of its own); returns the port."""
        farm = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "rank" or parts[2] != "metrics":
                    self.send_error(404)
                    return
                try:
                    body = farm.page(int(parts[1]))
                except (ValueError, IndexError):
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a scrape that timed out and left (a loaded machine)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def scrape_configs(self, port: int, job: str) -> list[dict]:
        """Prometheus static_configs: one target per rank, each with its path and an
        `instance` of its own (the ranks share one address)."""
        return [
            {
                "targets": [f"127.0.0.1:{port}"],
                "labels": {"__metrics_path__": f"/rank/{r}/metrics", "instance": f"sim-{r}"},
            }
            for r in range(self.ranks)
        ]
