"""How one profiler's metrics are served: as a member of the process's endpoint, or in a
registry of its own (Config.serve=False: the caller serves it, or nobody does).

Owns: the profiler's `SnapshotCollector`, the registry its metrics are in, its membership of
the endpoint (or its own system sampler and the collectors it put in a caller's registry),
and undoing all of that at detach.

Called by: the `Profiler` at attach (`join`, then `start` once training may begin) and through
the undo callables they return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from hookprof.config import Config
from hookprof.faults import Faults, ThreadSupervisor
from hookprof.handles import Handle
from hookprof.serve import endpoint
from hookprof.serve.endpoint import Endpoint, Member
from hookprof.serve.exporter import SnapshotCollector, make_registry
from hookprof.serve.system import SystemCollector, SystemSampler
from hookprof.step.record import StepCounters


class Serving:
    """One profiler's place on the /metrics page."""

    def __init__(
        self,
        config: Config,
        name: str,
        rank: int,
        local_rank: int,
        publisher: Any,
        registry: CollectorRegistry | None,
        *,
        faults: Faults | None = None,
        counters: StepCounters | None = None,
    ):
        self._config = config
        self._name = name
        self._rank = rank
        self._local_rank = local_rank
        self._publisher = publisher
        # the faults and the step count are exported from these as well as from the snapshot,
        # so that a snapshot that cannot be built leaves neither invisible
        self._faults = faults
        self._counters = counters
        self.collector = self._collector(build_info=True)
        self.endpoint: Endpoint | None = None
        self._system: SystemSampler | None = None
        self._registered: list[
            Any
        ] = []  # collectors put in a caller's registry: taken out at detach
        self.registry: CollectorRegistry | None = None
        if not config.serve:
            extra: tuple[Any, ...] = ()
            if config.system_metrics:
                system = self._system = SystemSampler(
                    config.system_interval_s,
                    gpus=config.gpu_metrics and local_rank == 0,  # one series per GPU per node
                    name=f"hookprof-system-rank{rank}",
                )
                extra = (SystemCollector(lambda: system.latest, rank),)
            self.registry = make_registry(
                self.collector,
                process_metrics=config.system_metrics,
                extra=extra,
                registry=registry,
                registered=self._registered if registry is not None else None,
            )

    def join(
        self, document: Callable[[int | None], dict[str, Any]], supervisor: ThreadSupervisor
    ) -> Handle:
        """Serving: join the process's endpoint on the configured port (base_port +
        LOCAL_RANK; it starts on the first member), its page re-rendered when this model's
        snapshot changes. Returns what leaves it (and takes out collectors put in a caller's
        registry)."""
        if self._config.serve:
            config = self._config
            port = config.port + self._local_rank if config.port else 0
            member = Member(
                self._name, self._collector(build_info=False), self._page_version, document=document
            )
            self.endpoint = endpoint.join(member, config, port, self._rank, self._local_rank)
            if self.endpoint is not None:  # (None: its port was taken, port_conflict="off")
                self.registry = self.endpoint.registry
                supervisor.watch("metrics server", self.endpoint)
        return Handle(self._leave)

    def start(self) -> Handle:
        """Start this profiler's own system sampler (not serving); returns the handle that
        stops it."""
        return self._system.start() if self._system is not None else Handle(lambda: None)

    def _collector(self, build_info: bool) -> SnapshotCollector:
        publisher = self._publisher
        # publisher "up" while it publishes: a thread alive but failing to build is not
        return SnapshotCollector(
            lambda: publisher.latest,
            torch.__version__,
            lambda: publisher.publishing,
            rank=self._rank,
            model=self._name,
            build_info=build_info,
            faults=self._faults,
            counters=self._counters,
        )

    def _page_version(self) -> tuple[Any, ...]:
        """What this model's part of the /metrics page is made from: the page is re-rendered
        when any of these changes (the step count only while the snapshot is stale: it is
        then read from the counters)."""
        publishing = self._publisher.publishing
        return (
            self._publisher.latest,
            publishing,
            self._faults.errors if self._faults is not None else None,
            None if publishing or self._counters is None else self._counters.steps,
        )

    def _leave(self) -> None:
        if self.endpoint is not None:
            self.endpoint.leave(self._name)
        registry = self.registry
        for collector in self._registered:  # (registered only where there is a registry)
            if registry is not None:
                registry.unregister(collector)
        self._registered = []

    @property
    def url(self) -> str | None:
        return self.endpoint.url if self.endpoint is not None else None

    @property
    def port(self) -> int | None:
        return self.endpoint.port if self.endpoint is not None else None

    @property
    def server(self) -> Any:
        """The process endpoint's MetricsServer (tests and benchmarks look at its page)."""
        return self.endpoint.server if self.endpoint is not None else None
