"""hookprof's own faults, not the model's: internal errors and the watch over its threads.

Internal errors are counted, logged once and never raised into training; a background
thread that died is reported and restarted a few times."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from hookprof.compiled import is_compiling
from hookprof.errors import NonFiniteError
from hookprof.handles import Handle

log = logging.getLogger("hookprof")

# The parts a fault is counted under (hookprof_internal_errors_total's `part` label), each
# exported from the start so that increase() sees its first fault, and which `where`s (the
# place a fault is reported from, said in the log) belong to each, by prefix. A `where` no
# prefix claims is counted under "other"; tests/unit/test_fault_parts.py finds every `where`
# in the package and checks that each has its part.
PARTS = (
    "layer hooks",
    "layer statistics",
    "step boundary",
    "nonfinite",
    "efficiency",
    "integrity",
    "stall watch",
    "publisher",
    "metrics server",
    "summary",
    "detach",
    "other",
)
_PART_OF_WHERE = (
    ("forward pre-hook", "layer hooks"),
    ("forward hook", "layer hooks"),
    ("backward hook", "layer hooks"),
    ("gradient hook", "layer hooks"),
    ("layer statistic", "layer statistics"),
    ("forward re-run", "layer hooks"),
    ("step boundary", "step boundary"),
    ("root forward", "step boundary"),
    ("optimizer", "step boundary"),
    ("GradScaler", "step boundary"),
    ("forward replay", "nonfinite"),
    ("nonfinite", "nonfinite"),
    ("incident", "nonfinite"),
    ("backward end", "nonfinite"),  # the every-step gradient check (step/backward_end.py)
    ("efficiency", "efficiency"),
    ("replica check", "integrity"),  # the parameters' fingerprint (hookprof/integrity/)
    ("replay check", "integrity"),  # a check step's forward replayed and compared
    ("spike replay", "integrity"),  # a spike's step replayed (integrity/spike_replay.py)
    ("update replay", "integrity"),  # an update run again (integrity/update_replay.py)
    ("stall watch", "stall watch"),
    ("publisher", "publisher"),
    ("snapshot", "publisher"),
    ("metrics server", "metrics server"),
    ("summary", "summary"),
    ("detach", "detach"),
)


def part_of(where: str) -> str:
    """The part (PARTS) a fault reported from `where` is counted under."""
    for prefix, part in _PART_OF_WHERE:
        if where.startswith(prefix):
            return part
    return "other"


class Faults:
    """Shared by every hook of one profiler. An internal error in the per-layer
    instrumentation (`report` with `disable`) switches it off for the rest of that step only
    (`broken`); it is tried again at a later step (`layers_off`), backing off while it keeps
    failing (DESIGN.md invariant 3). Step counting, gradient reading, the NaN checks and the
    exporter never read `broken`: they go on, and the failure is visible as
    `hookprof_internal_errors_total`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors = 0
        self.by_part = dict.fromkeys(PARTS, 0)  # the same faults, by part (part_of)
        self.broken = False  # the per-layer instrumentation failed: off until layers_off says
        self._logged: set[str] = set()
        # the step in progress, written as each one begins (StepEvents.begin_step)
        self.step = 0
        # counted in steps, not seconds (the clock is the step number): after n failures in a
        # row the layers wait 2**(n-1) steps, at most 64, so a fault that comes back at every
        # step costs one failed try per 64 steps, not one per step
        self._layers = Backoff(first_s=1.0, cap_s=64.0, clock=lambda: self.step)
        # the per-layer instrumentation failed and no step has run it through since (its
        # back-off is running): only then has a step's start anything to ask `layers_off`
        # (an attribute read on every other step, no call)
        self.recovering = False

    def layers_off(self) -> bool:
        """At the start of step `step` (asked while `recovering`): does the per-layer
        instrumentation stay off for it? Off only while its back-off lasts; a step that
        began with it on and met no fault resets the back-off."""
        with self._lock:
            if self.broken and self._layers.ready():
                self.broken = False  # tried again
            elif not self.broken and self._layers.failures > 0:  # .failing, inline
                self._layers.succeeded()
                self.recovering = False
            return self.broken

    @contextlib.contextmanager
    def contain(self, part: str, *, disable: bool = True) -> Iterator[None]:
        """`with faults.contain("summary"):` an exception from hookprof's own code inside is
        reported as a fault of `part` and goes no further; NonFiniteError (the `raise`
        policy speaking to the user) is let through. `guarded` is the same for a method."""
        try:
            yield
        except NonFiniteError:
            raise
        except Exception as exc:
            self.report(part, exc, disable=disable)

    def report(self, where: str, exc: BaseException, *, disable: bool = True) -> None:
        with self._lock:
            self.errors += 1
            self.by_part[part_of(where)] += 1
            if disable and not self.broken:
                self.broken = True  # for this step; retried by layers_off
                self.recovering = True
                self._layers.failed()
            first = where not in self._logged
            self._logged.add(where)
        if first:
            log.error(
                "hookprof: internal error in %s%s; training continues unaffected",
                where,
                "; per-layer instrumentation is off for this step and tried again later"
                if disable
                else "",
                exc_info=exc,
            )


class Backoff:
    """A part that keeps failing backs off instead of spinning (DESIGN.md invariant 3): after
    `n` failures in a row it is not tried again for `first_s * 2**(n-1)` seconds, at most
    `cap_s`; one success starts over. Owned by the thread that retries (the publisher: a
    snapshot that cannot be built), so the training thread never waits on it.

    Why: a loop that retries a failing step at once (its deadline already passed) spins a
    core, and on a 2-core machine that core is training's (571 -> 232 steps/s, measured)."""

    def __init__(
        self, first_s: float = 0.05, cap_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self._first_s = first_s
        self._cap_s = cap_s
        self._clock = clock
        self.failures = 0  # in a row
        self.until = 0.0  # not tried again before this (clock's time)

    def failed(self) -> float:
        """One more failure in a row; returns how long to wait before the next try."""
        self.failures += 1
        delay = min(self._cap_s, self._first_s * 2.0 ** min(self.failures - 1, 64))
        self.until = self._clock() + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.until = 0.0

    def ready(self) -> bool:
        """True when the part may be tried now (never failed, or its wait is over)."""
        return self.failures == 0 or self._clock() >= self.until

    @property
    def failing(self) -> bool:
        """Its last try failed (and no success since)."""
        return self.failures > 0


F = TypeVar("F", bound=Callable[..., Any])


def guarded(
    part: str,
    *,
    disable: bool = True,
    default: Any = None,
    locked: bool = False,
    compiling: Callable[..., Any] | None = None,
) -> Callable[[F], F]:
    """Fault containment for a method called from the training loop (a torch hook, a step
    boundary): an exception from hookprof's own code is reported to the object's `_faults` as
    a fault of `part` and the method returns `default`; training goes on. NonFiniteError (the
    `raise` policy speaking to the user) is the one exception let through. `disable=False`
    for parts whose failure must not switch the per-layer instrumentation off (for the rest
    of the step: Faults.layers_off). `locked`: the body runs holding the object's `_lock`,
    and not at all once its `detached` is set (the step boundary's hooks: a detach() on
    another thread either waits for the body or has finished before it starts; a copy's
    inert boundary, which has no lock, returns at once). `compiling` (with `locked`): what
    the method is while Dynamo traces it (a torch hook of a compiled model): called instead,
    with no lock (a lock cannot be traced) and no containment (an exception there is
    Dynamo's to handle, at trace time).

    One decorator instead of a `try/except` copied into every hook, so that what a fault
    switches off is decided here, in one place; one Python frame per hook call, lock and
    compiled branch included: a torch hook is the decorated method itself, with no
    unguarded method in front of it (these run at every boundary of every step: DESIGN.md
    invariant 11, and issue 37's count of Python calls per step)."""

    def wrap(method: F) -> F:
        if locked:  # the same containment with the lock inside it: one frame, not two nested

            @functools.wraps(method)
            def contained(self: Any, *args: Any, **kwargs: Any) -> Any:
                if self.detached:  # (read again under the lock below)
                    return default
                if compiling is not None and is_compiling():
                    return compiling(self, *args, **kwargs)
                try:
                    with self._lock:
                        if self.detached:
                            return default
                        return method(self, *args, **kwargs)
                except NonFiniteError:
                    raise
                except Exception as exc:
                    self._faults.report(part, exc, disable=disable)
                    return default

            return contained  # type: ignore[return-value]

        @functools.wraps(method)
        def contained_unlocked(self: Any, *args: Any, **kwargs: Any) -> Any:
            # a plain try (not Faults.contain): this runs in every hook, every step, and a
            # generator-based context manager costs ~1 us a call
            try:
                return method(self, *args, **kwargs)
            except NonFiniteError:
                raise
            except Exception as exc:
                self._faults.report(part, exc, disable=disable)
                return default

        return contained_unlocked  # type: ignore[return-value]

    return wrap


MAX_RESTARTS = 3  # per thread
SUPERVISE_AT_LEAST_EVERY_NS = 5_000_000_000  # hookprof's threads looked at, between sampled steps


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

    def start(self) -> Handle:
        """Start the thread; returns the handle that stops it (the subclass's `stop`)."""
        self._thread.start()
        return Handle(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

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
    training thread at the end of sampled steps (every ~2 s with the defaults), and at least
    every 5 s whatever the sampling (`due_ns`); not at every step: an unsampled step's work
    stays constant and small (DESIGN.md invariant 11). A dict walk, no waiting.

    `close()` (at detach, before the threads are stopped) ends it: a check running on the
    training thread while another thread detaches either finishes before the threads are
    stopped or sees closed, so nothing stopped by detach is started again."""

    def __init__(self, faults: Faults, say: Callable[[str, str], None] | None = None):
        self._faults = faults
        self._say = say
        # the process the threads were started in: a forked child has none of them (fork
        # copies the calling thread only), which is no fault of theirs (issue 39)
        self._pid = os.getpid()
        self._watched: dict[str, Restartable] = {}
        self._given_up: set[str] = set()  # reported as not restarted again
        self._lock = threading.Lock()  # a check against close()
        self._closed = False
        # the next check is due by this perf_counter_ns at the latest, sampled step or not
        # (read by the training thread at each step's end: an attribute, no call)
        self.due_ns = 0

    def watch(self, what: str, part: Restartable) -> None:
        self._watched[what] = part

    def close(self) -> None:
        """Detached: no thread is checked or restarted from now on (waits for a check)."""
        with self._lock:
            self._closed = True

    def check(self, now_ns: int = 0) -> None:
        self.due_ns = now_ns + SUPERVISE_AT_LEAST_EVERY_NS
        if self._closed:
            return
        with self._lock:
            if self._closed:
                return
            if os.getpid() != self._pid:
                self._started_in_fork()
                return
            for what, part in self._watched.items():
                if not part.alive:
                    self._revive(what, part)

    def _started_in_fork(self) -> None:
        """This process is a fork of the one that attached, and trains: the threads are
        started here, not counted as deaths, and said once."""
        parent, self._pid = self._pid, os.getpid()
        started = []
        for what, part in self._watched.items():
            if not part.alive:
                try:
                    part.restart()
                    part.restarts -= 1  # (not a death: no restart of the budget spent)
                    started.append(what)
                except Exception as exc:
                    self._faults.report(f"{what} thread restart", exc, disable=False)
        if self._say is not None:
            self._say(
                "forked",
                (
                    f"this process ({self._pid}) is a fork of {parent}, where hookprof was attached, "
                    f"and trains: threads do not survive a fork, so hookprof started its "
                    f"{' and '.join(started) or 'threads'} again here; its metrics endpoint stays the "
                    "parent's (this process does not serve it): attach in this process, after "
                    "prof.detach(), to serve its own"
                ),
            )

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
