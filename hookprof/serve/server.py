"""The /metrics endpoint: MetricsServer (hookprof/httpd.py serving prometheus_client's
exposition formats), the rendered page cached, and the endpoint's own connection counters.

Why a cache: formatting the exposition is pure Python and holds the GIL (8 ms for a 49-layer
model, 46 ms at 500 layers), so twenty scrapers in a loop took most of the training thread's
time. What the page shows changes only when a new snapshot is published (at most once per
`publish_interval_s`) or a system sample is taken, so the page is rendered again only then,
or when it is older than `max_age_s` (process CPU and memory move continuously).
"""

from __future__ import annotations

import errno
import gzip
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from hookprof.errors import PortInUseError
from hookprof.metrics_names import HTTP_CONNECTIONS_REJECTED_TOTAL, family
from hookprof.serve.httpd import REJECT_REASONS, Limits, Server


class CachedPage:
    """The rendered exposition of `registry` per format, shared by every request."""

    def __init__(
        self, registry: Any, version: Callable[[], tuple[Any, ...]], max_age_s: float = 1.0
    ):
        # version(): the objects the page is made from (snapshots, flags); a page is reused
        # while they are the very same objects (identity, not equality: cheap, and an old
        # object stays referenced so its id cannot be recycled)
        self._registry = registry
        self._version = version
        self._max_age_s = max_age_s
        self._lock = threading.Lock()  # one render at a time; the others wait and reuse it
        self._pages: dict[tuple[bool, bool], tuple[tuple[Any, ...], float, bytes]] = {}
        self.renders = 0

    def get(self, open_metrics: bool, compressed: bool) -> bytes:
        key = (open_metrics, compressed)
        with self._lock:
            version, now = self._version(), time.monotonic()
            cached = self._pages.get(key)
            if (
                cached is not None
                and now - cached[1] < self._max_age_s
                and len(cached[0]) == len(version)
                and all(a is b for a, b in zip(cached[0], version))
            ):
                return cached[2]
            render = openmetrics.generate_latest if open_metrics else generate_latest
            body = render(self._registry)
            self.renders += 1
            if compressed:
                body = gzip.compress(body, compresslevel=1)
            self._pages[key] = (version, now, body)
            return body


def make_app(
    page: CachedPage, history: CachedHistory | None = None, recent: CachedHistory | None = None
) -> Callable:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])
            return [b""]
        if history is not None and environ.get("PATH_INFO") == HISTORY_PATH:
            start_response("200 OK", [("Content-Type", "application/json")])
            wanted = recent if environ.get("QUERY_STRING") == RECENT_QUERY else None
            return [(wanted or history).get()]
        open_metrics = "application/openmetrics-text" in environ.get("HTTP_ACCEPT", "")
        compressed = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
        body = page.get(open_metrics, compressed)
        headers = [
            (
                "Content-Type",
                openmetrics.CONTENT_TYPE_LATEST if open_metrics else CONTENT_TYPE_LATEST,
            )
        ]
        if compressed:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


HISTORY_PATH = "/history.json"  # the run report's data (hookprof/report.py)
RECENT_QUERY = "recent"  # /history.json?recent: the last RECENT_STEPS steps only (`top`)
RECENT_STEPS = 120


class CachedHistory:
    """/history.json, made again at most once per `max_age_s` however many ask: making it
    holds the GIL (0.1-0.3 s on a loaded 2-core machine at the history's full size), which the
    training thread needs; a report a few seconds old is as good."""

    def __init__(self, make: Callable[[], bytes], max_age_s: float = 5.0):
        self._make = make
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._body: tuple[float, bytes] | None = None

    def get(self) -> bytes:
        with self._lock:
            now = time.monotonic()
            if self._body is None or now - self._body[0] >= self._max_age_s:
                self._body = (now, self._make())
            return self._body[1]


def tls_context(certfile: str, keyfile: str | None, client_cafile: str | None) -> ssl.SSLContext:
    """Server-side TLS as prometheus_client sets it up; with a client CA, a client must
    present a certificate that CA signed (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    if client_cafile is not None:
        context.load_verify_locations(cafile=client_cafile)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ConnectionCounters(Collector):
    """hookprof_http_connections_rejected_total{reason}: connections the endpoint refused or
    closed, by reason (hookprof/httpd.py REJECT_REASONS), each pre-initialised to 0 so that
    increase() sees the first one. Counted by the server's threads, read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REJECT_REASONS, 0)

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rejected = family(HTTP_CONNECTIONS_REJECTED_TOTAL)
        for reason, count in self.counts().items():
            rejected.add_metric([reason], count)
        yield rejected


class MetricsServer:
    """The /metrics endpoint on one (addr, port), with a clean stop. Its connection counters
    are registered in `registry`, so they are on the page they protect."""

    def __init__(
        self,
        registry: CollectorRegistry,
        addr: str,
        port: int,
        *,
        version: Callable[[], tuple[Any, ...]] = tuple,
        certfile: str | None = None,
        keyfile: str | None = None,
        client_cafile: str | None = None,
        limits: Limits | None = None,
        history: Callable[[int | None], bytes] | None = None,
    ):
        from hookprof.config import Config

        self.page = CachedPage(registry, version)
        self.history = CachedHistory(lambda: history(None)) if history is not None else None
        # small and asked for every second by `top`: made again at most once a second
        self.recent = (
            CachedHistory(lambda: history(RECENT_STEPS), max_age_s=1.0)
            if history is not None
            else None
        )
        self.limits = limits if limits is not None else Limits.from_config(Config())
        self.connections = ConnectionCounters()
        self._context = (
            tls_context(certfile, keyfile, client_cafile) if certfile is not None else None
        )
        self.addr = addr
        self.restarts = 0
        self._start(port)
        registry.register(self.connections)
        self.port: int = self._server.server_address[1]
        self.scheme = "https" if self._context is not None else "http"

    def _start(self, port: int) -> None:
        try:
            self._server = Server(
                self.addr,
                port,
                make_app(self.page, self.history, self.recent),
                self.limits,
                context=self._context,
                on_reject=self.connections.add,
            )
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortInUseError(self.addr, port, exc) from exc
            raise
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hookprof-http", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        # in a forked child the server is the parent's: it never serves there, so there is
        # nothing to watch or restart
        return self._server.forked or self._thread.is_alive()

    def restart(self) -> None:
        """Serve again on the same port after the serving thread ended."""
        if self._server.forked:
            return
        self.restarts += 1
        self._server.server_close()
        self._start(self.port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
