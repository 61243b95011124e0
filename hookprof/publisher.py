"""The background daemon thread: waits for each sampled step's device copy, folds it in,
and publishes an immutable Snapshot by swapping one reference."""

from __future__ import annotations

import queue
import threading
from typing import Any

from .aggregate import Aggregator, Packet, StepCounters
from .health import Health
from .snapshot import Snapshot

_STOP = object()


class Publisher:
    def __init__(
        self,
        aggregator: Aggregator,
        counters: StepCounters,
        health: Health,
        timer: Any,
        interval_s: float,
        name: str = "hookprof-publisher",
    ):
        self._aggregator = aggregator
        self._counters = counters
        self._health = health
        self._timer = timer
        self._interval_s = interval_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.latest: Snapshot = aggregator.snapshot(counters, health.errors)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, packet: Packet) -> None:
        self._queue.put(packet)

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until everything submitted so far is folded and published."""
        if not self._thread.is_alive():
            self._publish()
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _publish(self) -> None:
        self.latest = self._aggregator.snapshot(self._counters, self._health.errors)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._interval_s)
            except queue.Empty:
                item = None
            try:
                if item is _STOP:
                    self._publish()
                    return
                if isinstance(item, Packet):
                    self._aggregator.fold(item, self._timer)
                self._publish()
            except Exception as exc:  # never die: a lost sample is better than no exporter
                self._health.report("publisher thread", exc, disable=False)
            finally:
                if isinstance(item, threading.Event):
                    item.set()
