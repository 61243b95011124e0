"""hookprof's own faults, not the model's: internal errors and the watch over its threads.

Internal errors are counted, logged once and never raised into training; a background
thread that died is reported and restarted a few times."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger("hookprof")


class Faults:
    """Shared by every hook of one profiler. The first internal error switches the per-layer
    instrumentation off for good (DESIGN.md invariant 3); step counting and the exporter
    keep working so the failure is visible as `hookprof_internal_errors_total`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors = 0
        self.broken = False
        self._logged: set[str] = set()

    def report(self, where: str, exc: BaseException, *, disable: bool = True) -> None:
        with self._lock:
            self.errors += 1
            self.broken = self.broken or disable
            first = where not in self._logged
            self._logged.add(where)
        if first:
            log.error(
                "hookprof: internal error in %s%s; training continues unaffected",
                where,
                "; per-layer instrumentation is now off" if disable else "",
                exc_info=exc,
            )


MAX_RESTARTS = 3  # per thread


class Restartable(Protocol):
    """A background part of hookprof that runs a thread of its own."""

    restarts: int

    @property
    def alive(self) -> bool: ...

    def restart(self) -> None: ...


class DaemonThread:
    """A Restartable whose thread runs `self._run`: the publisher, the stall watch. A
    restart starts a new thread over the same state (queues, totals) as the one that died."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.restarts = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def restart(self) -> None:
        self.restarts += 1
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class ThreadSupervisor:
    """hookprof's own threads end only when detach() stops them: one that ended anyway (its
    loop catches every Exception, so something stronger killed it) is reported (log,
    hookprof_internal_errors_total) and started again, a few times at most. Checked by the
    training thread at step boundaries: a dict walk, no waiting."""

    def __init__(self, faults: Faults):
        self._faults = faults
        self._watched: dict[str, Restartable] = {}
        self._given_up: set[str] = set()  # reported as not restarted again

    def watch(self, what: str, part: Restartable) -> None:
        self._watched[what] = part

    def check(self) -> None:
        for what, part in self._watched.items():
            if not part.alive:
                self._revive(what, part)

    def _revive(self, what: str, part: Restartable) -> None:
        err = RuntimeError(f"hookprof {what} thread died")
        if part.restarts >= MAX_RESTARTS:
            if what not in self._given_up:
                self._given_up.add(what)
                self._faults.report(f"{what} thread (not restarted again)", err, disable=False)
            return
        self._faults.report(f"{what} thread (restart {part.restarts + 1})", err, disable=False)
        try:
            part.restart()
        except Exception as exc:  # e.g. the port was taken meanwhile: reported, not raised
            self._faults.report(f"{what} thread restart", exc, disable=False)
