"""The process's metrics endpoint: one per address and port, serving every attached model.

A GAN's generator and discriminator, a teacher and its student, an EMA copy under test: each
profiler of a process that asks for the same address and port joins the endpoint the first
one started, and its series carry a `model` label (the model's name, unique in the process).
Per-process series (process_*, host, GPUs, CUDA memory, build info, rejected connections)
appear once. The endpoint closes when its last model leaves; detaching one model leaves the
others served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hookprof._version import __version__
from hookprof.config import Config
from hookprof.errors import ConfigError, PortInUseError
from hookprof.metrics_names import BUILD_INFO, family
from hookprof.serve.exporter import SnapshotCollector, make_registry
from hookprof.serve.port_conflict import PortConflict, PortConflictInfo, port_holder
from hookprof.serve.server import Limits, MetricsServer
from hookprof.serve.system import SystemCollector, SystemSampler

# what every model joining an endpoint must agree on with the one that started it
SHARED_FIELDS = (
    "tls_certfile",
    "tls_keyfile",
    "tls_client_cafile",
    "system_metrics",
    "gpu_metrics",
    "system_interval_s",
    "http_max_requests",
    "http_max_connections",
    "http_header_timeout_s",
    "http_idle_timeout_s",
    "http_write_timeout_s",
)

_endpoints: dict[tuple[str, int], Endpoint] = {}
_lock = threading.Lock()


class Member:
    """One model on an endpoint: its collector and what its page is made from."""

    def __init__(
        self,
        name: str,
        collector: SnapshotCollector,
        version: Callable[[], tuple[Any, ...]],
        document: Callable[[int | None], dict[str, Any]],
    ):
        self.name = name
        self.collector = collector
        self.version = version
        self.document = document  # the run report's data (report.py), served at /history.json


def join(member: Member, config: Config, port: int, rank: int, local_rank: int) -> Endpoint | None:
    """The endpoint serving (config.addr, port), started if none does; `member` is on it.
    Port 0 always starts one of its own (it picks a free port). A port held elsewhere:
    `config.port_conflict` says what follows (serve/port_conflict.py); None when nothing
    serves ("off")."""
    with _lock:
        # (a port found taken before is looked up too: the endpoint on the free port serves it)
        endpoint = _endpoints.get((config.addr, port)) if port else None
        if endpoint is None:
            try:
                endpoint = Endpoint(config, port, rank, local_rank)
            except PortInUseError as taken:
                ours = next((e for (_, p), e in _endpoints.items() if p == port), None)
                exc = taken
                if ours is not None:  # this process serves that port on another address: whose
                    exc = PortInUseError(
                        config.addr, port, holder=", ".join(m.name for m in ours.members())
                    )
                if config.port_conflict == "raise":
                    raise exc from None  # (the holder named: the first error adds nothing)
                conflict = PortConflict(config.addr, port, _holder(exc, port))
                if config.port_conflict == "off":
                    conflict.say(None)
                    return None
                endpoint = Endpoint(config, 0, rank, local_rank, conflict=conflict)
                conflict.say(endpoint.port)
                _endpoints[(config.addr, port)] = endpoint  # later models asking for it join it
            _endpoints[(config.addr, endpoint.port)] = endpoint
        else:
            endpoint.check_settings(config)
        endpoint.add(member)
        return endpoint


def _holder(exc: PortInUseError, port: int) -> str | None:
    if exc.holder is not None:
        return f"this process (hookprof serving {exc.holder} on another address)"
    return port_holder(port)


class Endpoint:
    def __init__(
        self,
        config: Config,
        port: int,
        rank: int,
        local_rank: int,
        *,
        conflict: PortConflict | None = None,
    ):
        self.config = config
        self.conflict = conflict  # the taken port this endpoint stands in for
        self._members: dict[str, Member] = {}
        self._members_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._closed = False  # its last member left: never served again
        self.system: SystemSampler | None = None
        extra: tuple[Collector, ...] = (_BuildInfo(),)
        if conflict is not None:
            extra += (PortConflictInfo(conflict),)
        if config.system_metrics:
            self.system = system = SystemSampler(
                config.system_interval_s,
                gpus=config.gpu_metrics and local_rank == 0,  # one series per GPU per node
                name=f"hookprof-system-rank{rank}",
            )
            extra += (SystemCollector(lambda: system.latest, rank),)
        self.registry = make_registry(
            _Models(self), process_metrics=config.system_metrics, extra=extra
        )
        self.server = MetricsServer(
            self.registry,
            config.addr,
            port,
            version=self._page_version,
            certfile=config.tls_certfile,
            keyfile=config.tls_keyfile,
            client_cafile=config.tls_client_cafile,
            limits=Limits.from_config(config),
            history=self._history_json,
        )
        if self.system is not None:
            self.system.start()

    # what ThreadSupervisor watches: the server thread, restarted once however many models see it
    @property
    def alive(self) -> bool:
        return self.server.alive

    @property
    def restarts(self) -> int:
        return self.server.restarts

    @restarts.setter
    def restarts(self, value: int) -> None:
        # (ThreadSupervisor gives a restart back in a forked child: a read-only property
        # made that an AttributeError, counted as a failed restart; found by mypy)
        self.server.restarts = value

    def restart(self) -> None:
        with self._restart_lock:  # two models' step boundaries may notice it at once
            if not self._closed and not self.server.alive:
                self.server.restart()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def check_settings(self, config: Config) -> None:
        for field in SHARED_FIELDS:
            mine, theirs = getattr(self.config, field), getattr(config, field)
            if mine != theirs:
                raise ConfigError(
                    field,
                    theirs,
                    (
                        f"{mine!r}, as for the models already served on {self.url} (one endpoint per "
                        "address and port serves every model of a process; choose another port for "
                        "other settings)"
                    ),
                )

    def add(self, member: Member) -> None:
        with self._members_lock:
            self._members[member.name] = member

    def members(self) -> list[Member]:
        with self._members_lock:
            return list(self._members.values())

    def leave(self, name: str) -> None:
        """`name` is no longer served; the last to leave closes the endpoint."""
        with _lock:
            with self._members_lock:
                self._members.pop(name, None)
                empty = not self._members
            if empty:
                for key in [key for key, endpoint in _endpoints.items() if endpoint is self]:
                    del _endpoints[key]
        if empty:
            with self._restart_lock:  # a restart in progress ends first; none starts after
                self._closed = True
            if self.system is not None:
                self.system.stop()
            self.server.close()

    def _history_json(self, recent: int | None = None) -> bytes:
        """/history.json: every member's report document (report.py); with `recent`, their
        last steps only (/history.json?recent: `hookprof top`)."""
        from hookprof.publish.document import to_json

        return to_json([m.document(recent) for m in self.members()])

    def _page_version(self) -> tuple[Any, ...]:
        """What the page is made from: it is re-rendered when any of these changes."""
        parts: list[Any] = [self.system.latest if self.system is not None else None]
        for member in self.members():
            parts.extend(member.version())
        return tuple(parts)


class _Models(Collector):
    """Every member's families, those of the same name merged into one (two models' steps
    are two samples of one `hookprof_steps_total` family, told apart by `model`)."""

    def __init__(self, endpoint: Endpoint):
        self._endpoint = endpoint

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for member in self._endpoint.members():
            for built in member.collector.collect():  # never raises (see its guard)
                have = merged.get(built.name)
                if have is None:
                    merged[built.name] = built
                else:
                    have.samples.extend(built.samples)
        yield from merged.values()


class _BuildInfo(Collector):
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        build = family(BUILD_INFO)
        build.add_metric([__version__, torch.__version__], 1)
        yield build
