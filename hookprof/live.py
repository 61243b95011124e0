"""The live profilers of this process: the one registry of them.

Owns: which profilers are attached and not yet detached, their `model` labels (unique in
the process: the endpoint serves every model under its label), the release of profilers
whose model was dropped (a notebook cell run again), `hookprof.detach_all()`, and the
summary said at interpreter exit for those still attached then.

Called by: `Profiler` (`release_orphans`, `refuse_overlap`, `reserve_name` at attach, `add`
when attach succeeded, `remove` at detach), `hookprof.detach_all`, and tests through
`hookprof._testing`. Nothing else keeps a list of profilers.
"""

from __future__ import annotations

import atexit
import gc
import threading
from typing import Any, Protocol

from hookprof.errors import AlreadyAttachedError
from hookprof.faults import log
from hookprof.snapshot import Snapshot
from hookprof.view import summary


class Profiler(Protocol):
    """What the registry needs of a profiler (profiler.Profiler), so that the registry does
    not import the module that imports it."""

    name: str
    model_type: str

    @property
    def model(self) -> Any: ...

    @property
    def detached(self) -> bool: ...

    def detach(self) -> None: ...

    def flush(self, timeout: float | None = ...) -> bool: ...

    def snapshot(self) -> Snapshot: ...


AT_EXIT_FLUSH_S = 2.0  # at exit, how long to wait for the last steps to be folded in

_lock = threading.Lock()
_live: dict[Profiler, frozenset[int]] = {}  # attached, not yet detached -> its modules' ids
_names: set[str] = set()  # the `model` labels taken, from reserve_name to remove
# the live profilers whose summary is said at exit (Config.summary_at_exit): the atexit hook
# is registered only while there is one
_summarised: set[Profiler] = set()
_at_exit_registered = False


def profilers() -> list[Profiler]:
    """The live profilers, a copy (safe to iterate while others attach or detach)."""
    with _lock:
        return list(_live)


def refuse_overlap(module_ids: frozenset[int]) -> None:
    """AlreadyAttachedError naming the live profiler that already holds one of these modules."""
    with _lock:
        for other, theirs in _live.items():
            if not theirs.isdisjoint(module_ids):
                raise AlreadyAttachedError(other)


def reserve_name(base: str) -> str:
    """`base`, or `base-2`, `base-3`, ... : the first not taken by a live profiler. Held
    until `remove`."""
    with _lock:
        name, k = base, 1
        while name in _names:
            k += 1
            name = f"{base}-{k}"
        _names.add(name)
        return name


def same_kind(model_type: str) -> list[str]:
    """The names of live profilers of models of this class (a second model of a kind, or a
    notebook cell run again)."""
    with _lock:
        return [p.name for p in _live if p.model_type == model_type]


def earlier_notice(model_type: str, name: str) -> str | None:
    """What to say when another model of this class is still attached: a second model of a
    kind, or a notebook cell run again (whose earlier model would be served for ever)."""
    earlier = [other for other in same_kind(model_type) if other != name]
    if not earlier:
        return None
    return (
        f"another {model_type} is attached in this process (served as model={earlier[0]!r}); "
        f"this one is served as model={name!r}. If a notebook cell ran again, "
        "hookprof.detach_all() releases the earlier one"
    )


def add(prof: Profiler, module_ids: frozenset[int], *, summary_at_exit: bool) -> None:
    """`prof` is attached to the modules `module_ids`: it is live, and (if asked) says its
    summary at exit."""
    global _at_exit_registered
    with _lock:
        _live[prof] = module_ids
        if summary_at_exit:
            _summarised.add(prof)
            if not _at_exit_registered:
                atexit.register(_at_exit)
                _at_exit_registered = True


def remove(prof: Profiler, name: str | None) -> None:
    """`prof` is detached (or its attach failed): forget it and free its name."""
    global _at_exit_registered
    with _lock:
        _live.pop(prof, None)
        _names.discard(name)
        _summarised.discard(prof)
        if not _summarised and _at_exit_registered:
            atexit.unregister(_at_exit)
            _at_exit_registered = False


def at_exit_watched() -> tuple[bool, list[Profiler]]:
    """Is the exit hook registered, and for which profilers (tests look at this)."""
    with _lock:
        return _at_exit_registered, list(_summarised)


def detach_all() -> int:
    """Detach every profiler of this process (a notebook cell that attached again, a test's
    cleanup). Returns how many were detached."""
    live = profilers()
    for prof in live:
        prof.detach()
    return len(live)


def release_orphans() -> None:
    """Detach every live profiler whose model is gone: a notebook cell that runs
    `model = Net(); prof = hookprof.attach(model)` again drops the earlier model, and its
    profiler would otherwise keep the port, its threads and its global optimizer hooks for
    ever. Called at attach(), on the attaching thread."""
    live = profilers()
    if not live:
        return
    if any(p.model is not None for p in live):
        # a dropped model can be held a little longer by a reference cycle of its own:
        # collect once, here, where a pause is expected (one full collection per attach,
        # only while another profiler is live)
        gc.collect()
    for prof in live:
        if prof.model is None and not prof.detached:
            log.info(
                "hookprof: released the profiler of %s (model=%r): its model is gone (a "
                "notebook cell run again, or a model dropped without detach())",
                prof.model_type,
                prof.name,
            )
            prof.detach()


def _at_exit() -> None:
    with _lock:
        watched = list(_summarised)
    for prof in watched:
        try:
            if prof.detached:
                continue
            prof.flush(AT_EXIT_FLUSH_S)
            summary.say(summary.summary_text(prof.snapshot(), prof.name))
        except Exception:  # never fail an exiting interpreter
            pass
