"""The background daemon thread that folds sampled steps in and publishes Snapshots.

It waits for each sampled step's device copy, folds it into the totals, and publishes an
immutable Snapshot by swapping one reference. A packet arrives when its step ends; it is
folded when the training thread nudges (at the end of the next forward, so the Python work
overlaps the backward pass, which seldom needs the GIL, rather than the forward, which needs
it at every module call), or at the latest `interval_s` after it arrived: the last step of a
run that stops or hangs is published all the same."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from hookprof.device.timing import Timer
from hookprof.faults import Backoff, DaemonThread, Faults
from hookprof.notices import Notices
from hookprof.publish.aggregate import Aggregator
from hookprof.publish.history import LAYER_SLOTS, History
from hookprof.snapshot import Snapshot
from hookprof.step.record import Packet, StepCounters

_STOP = object()
_NUDGE = object()


class _Settle(threading.Event):
    """A request to fold the waiting packets whose copies have completed, and publish."""


class _PublishNow:
    """A request to fold what has arrived and publish at once, not at the next interval:
    an incident's drain or replay (IncidentResponse reads `latest` at the next step ends)."""

    __slots__ = ("token",)

    def __init__(self, token: int):
        self.token = token


class Publisher(DaemonThread):
    def __init__(
        self,
        aggregator: Aggregator,
        counters: StepCounters,
        faults: Faults,
        timer: Timer,
        interval_s: float,
        name: str = "hookprof-publisher",
        notices: Notices | None = None,
        history: History | None = None,
        decorate: Callable[[Snapshot], Snapshot] | None = None,
    ):
        self._aggregator = aggregator
        self._counters = counters
        self._faults = faults
        self._timer = timer
        self._interval_s = interval_s
        self._notices = notices if notices is not None else Notices()
        self.history = history  # the report's bounded history, fed after each fold
        # adds what other parts own (the step phases, the stall watch) to each snapshot
        self._decorate = decorate
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: list[Packet] = []  # arrived, not folded yet (kept across a restart)
        # the batches of packets submitted and not folded yet, in order (settle reads them)
        self._in_flight: deque[Any] = deque()
        self._in_flight_lock = threading.Lock()
        self._oldest = 0.0  # when the oldest waiting packet arrived (monotonic)
        # a snapshot that cannot be built (or a loop that keeps failing) is retried later and
        # later, not at once: retried at once, its deadline already passed, it spun a core
        self._backoff = Backoff()
        self.latest: Snapshot = self._build()
        self._requested = 0  # publish_now requests made (training thread)
        self.published_token = 0  # the last one whose fold is in `latest` (publisher thread)
        self._wanted_token = 0  # the last one whose packets are folded (publisher thread)
        DaemonThread.__init__(self, name)

    def spike_gate_limits(self) -> tuple[float, float, float, float]:
        """(loss, gradient norm) above which the spike replay replays a step, then above
        which the rule calls it a spike, as of the last drain folded (publish/spikes.py
        `gate_limits`); read from the training thread."""
        return self._aggregator.spikes.gate_limits

    def update_ratio_limits(self) -> Mapping[str, tuple[float, float]]:
        """Per layer, the update ratios above which the spike replay replays a step, then
        above which the rule calls its next measurement a jump (publish/spikes.py
        `layer_limits`; absent: no judgement yet); read from the training thread, an entry
        at a time."""
        return self._aggregator.spikes.layer_limits

    def submit(self, packet: Packet) -> None:
        with self._in_flight_lock:
            self._in_flight.append(packet.batch)
        self._queue.put(packet)

    def settle(self, timeout: float = 2.0) -> bool:
        """Fold and publish now the packets, oldest first, whose copies have completed, and
        return True once that is done: the caller waits for the publisher's Python work only,
        never for a device (a packet whose copy is still in flight stops the folding). False
        at once when the oldest packet's copy is still in flight. For a NaN policy waiting
        on a drain or a replay: it acts at the first step end after the device has caught up
        with it, whatever the publisher thread's scheduling."""
        with self._in_flight_lock:
            oldest = self._in_flight[0] if self._in_flight else None
        if oldest is None or not oldest.ready() or not self._thread.is_alive():
            return False
        done = _Settle()
        self._queue.put(done)
        return done.wait(timeout)

    def nudge(self) -> None:
        """Fold what has arrived now (the training thread is about to run a backward)."""
        self._queue.put(_NUDGE)

    def publish_now(self) -> int:
        """Fold what has been submitted so far and publish it as soon as its copies have
        completed (waited for here, on the publisher thread), not at the next interval.
        Never waits on the caller's thread. Returns a token: `published_token >= token` once
        `latest` holds it."""
        self._requested += 1
        self._queue.put(_PublishNow(self._requested))
        return self._requested

    def fold(self, packet: Packet) -> None:
        """Fold one packet into the totals (on the publisher thread)."""
        self._aggregator.fold(packet, self._timer)
        if self.history is not None:
            self.history.observe(packet, self._aggregator, self._counters)

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

    @property
    def publishing(self) -> bool:
        """The thread is alive and its last snapshot build succeeded: `latest` is current
        (up to one interval). False while a failing build backs off: `latest` is stale."""
        return self.alive and not self._backoff.failing

    def _publish(self) -> None:
        self.latest = self._build()
        self._backoff.succeeded()
        # a publish_now whose packets were folded is in `latest` now, whichever publish it was
        self.published_token = max(self.published_token, self._wanted_token)

    def _build(self) -> Snapshot:
        snap = self._aggregator.snapshot(self._counters, self._faults.errors, self._notices.all())
        return snap if self._decorate is None else self._decorate(snap)

    def _run(self) -> None:
        # snapshots are rebuilt at most once per interval (or on flush): on a busy 2-core
        # machine every millisecond of Python here is taken from the training threads
        last_publish = time.monotonic()
        while True:
            now = time.monotonic()
            due = last_publish + self._interval_s
            if self._waiting:
                due = min(due, self._oldest + self._interval_s)
            if self._backoff.failing:
                due = max(due, self._backoff.until)
            try:
                item = self._queue.get(timeout=due - now) if due > now else self._queue.get_nowait()
            except queue.Empty:
                item = None
            try:
                if isinstance(item, Packet):
                    if not self._waiting:
                        self._oldest = time.monotonic()
                    self._waiting.append(item)
                    continue
                if isinstance(item, _Settle):  # (set in `finally`)
                    self._fold_waiting(ready_only=True)
                    if self._backoff.ready():
                        self._publish()
                    last_publish = time.monotonic()
                    continue
                now = time.monotonic()
                if item is not None or now - self._oldest >= self._interval_s:
                    self._fold_waiting()  # nudged, flushed, stopping, or waited long enough
                if item is _STOP:  # one last try, whatever the back-off; a failure ends it too
                    with self._faults.contain("publisher thread", disable=False):
                        self._publish()
                    return
                if isinstance(
                    item, _PublishNow
                ):  # its packets are folded: the next publish holds them
                    self._wanted_token = max(self._wanted_token, item.token)
                # a nudge comes every step: while backing off only a flush (the caller asked
                # and waits) tries before the back-off is over
                if (item is not _NUDGE or now - last_publish >= self._interval_s) and (
                    self._backoff.ready() or type(item) is threading.Event
                ):
                    self._publish()
                    last_publish = time.monotonic()
            except Exception as exc:  # never die: a lost sample is better than no exporter
                self._backoff.failed()
                self._faults.report("publisher thread", exc, disable=False)
            finally:
                if isinstance(item, threading.Event):
                    item.set()

    def _fold_waiting(self, ready_only: bool = False) -> None:
        """Fold the waiting packets in order (`ready_only`: while their copies have completed,
        so this thread waits for no device either)."""
        while self._waiting:
            if ready_only and not self._waiting[0].batch.ready():
                break
            packet = self._waiting.pop(0)
            try:
                self.fold(packet)
            except Exception as exc:  # one bad packet costs that packet only
                self._faults.report("publisher thread", exc, disable=False)
            finally:
                with self._in_flight_lock:
                    if self._in_flight:
                        self._in_flight.popleft()


def for_model(
    make: Callable[..., Publisher],
    table: Any,
    rank: int,
    config: Any,
    counters: StepCounters,
    faults: Faults,
    timer: Timer,
    notices: Notices,
    *,
    efficiency: Any,
    device_phases: Any,
    decorate: Callable[[Snapshot], Snapshot],
    statistics: tuple[Any, ...] = (),
    replica_group: str = "",
) -> Publisher:
    """A model's publisher (`make`: Publisher, or a test's subclass) over its own totals and
    the report's bounded history, with its slice of the config (publish_interval_s, and the
    aggregator's and history's)."""
    return make(
        Aggregator.for_table(
            table,
            rank,
            config,
            efficiency=efficiency,
            device_phases=device_phases,
            statistics=statistics,
            replica_group=replica_group,
            # a statistic's fold that raised: that value lost, nothing switched off
            report=lambda part, exc: faults.report(part, exc, disable=False),
        ),
        counters,
        faults,
        timer,
        config.publish_interval_s,
        name=f"hookprof-publisher-rank{rank}",
        notices=notices,
        decorate=decorate,
        history=History(
            table.names,
            layer_slots=min(LAYER_SLOTS, config.max_layers),
            container_names=[name for name, _ in table.containers],
        ),
    )
