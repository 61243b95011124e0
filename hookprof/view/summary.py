"""The short summary said when a profiler is detached, or when the interpreter exits while one
is still attached (Config.summary_at_exit): steps, step time, NaN/Inf, the costliest layers.

It goes to the "hookprof" logger when the program has set up logging to show INFO, else
straight to stderr: a summary nobody sees (Python's default shows warnings only) would be
no summary."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING

from hookprof.faults import log
from hookprof.snapshot import Snapshot

if TYPE_CHECKING:
    from hookprof.profiler import Profiler

TOP_LAYERS = 5
AT_EXIT_FLUSH_S = 2.0  # at exit, how long to wait for the last steps to be folded in

_watched: "weakref.WeakSet[Profiler]" = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def summary_text(snap: Snapshot, model: str = "") -> str:
    # the table's code loads here, at detach or exit, not with `import hookprof`
    from hookprof.view.table import fmt_seconds, fmt_share, from_snapshot, nonfinite_line, sort_rows

    table = from_snapshot(snap, model)
    h = table.header
    who = f"{model}, rank {h.rank}" if model else f"rank {h.rank}"
    top = [r for r in sort_rows(table.rows, "share") if r.share is not None][:TOP_LAYERS]
    lines = [
        f"hookprof summary ({who}): {h.steps} steps, {h.sampled_steps} sampled; step time "
        f"p50 {fmt_seconds(h.step_quantile(0.5))}, p95 {fmt_seconds(h.step_quantile(0.95))}",
        "  " + nonfinite_line(h),
        "  top layers by share of step time: "
        + (", ".join(f"{r.layer} {fmt_share(r.share)}" for r in top) if top else "none timed"),
    ]
    return "\n".join(lines)


def say(text: str) -> None:
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)


def watch(prof: "Profiler") -> None:
    """Say `prof`'s summary at interpreter exit if it is still attached then. Weakly held:
    the watch keeps nothing alive; the atexit hook is there only while something is watched."""
    global _registered
    with _lock:
        _watched.add(prof)
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def forget(prof: "Profiler") -> None:
    global _registered
    with _lock:
        _watched.discard(prof)
        if not _watched and _registered:
            atexit.unregister(_at_exit)
            _registered = False


def _at_exit() -> None:
    with _lock:
        live = list(_watched)
    for prof in live:
        try:
            if prof.detached:
                continue
            prof.flush(AT_EXIT_FLUSH_S)
            say(summary_text(prof.snapshot(), prof.name))
        except Exception:  # never fail an exiting interpreter
            pass
