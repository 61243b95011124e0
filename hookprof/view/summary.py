"""The short summary said when a profiler is detached, or when the interpreter exits while one
is still attached (Config.summary_at_exit; the exit hook is live.py's): steps, step time, NaN/Inf,
the costliest layers.

It goes to the "hookprof" logger when the program has set up logging to show INFO, else
straight to stderr: a summary nobody sees (Python's default shows warnings only) would be
no summary."""

from __future__ import annotations

import logging
import sys

from hookprof.faults import log
from hookprof.snapshot import Snapshot

TOP_LAYERS = 5


def summary_text(snap: Snapshot, model: str = "") -> str:
    # the table's code loads here, at detach or exit, not with `import hookprof`
    from hookprof.view.table import (
        fmt_seconds,
        fmt_share,
        from_snapshot,
        nonfinite_line,
        replay_line,
        sort_rows,
        spike_line,
        spike_replay_line,
    )

    table = from_snapshot(snap, model)
    h = table.header
    who = f"{model}, rank {h.rank}" if model else f"rank {h.rank}"
    top = [r for r in sort_rows(table.rows, "share") if r.share is not None][:TOP_LAYERS]
    lines = [
        f"hookprof summary ({who}): {h.steps} steps, {h.sampled_steps} sampled; step time "
        f"p50 {fmt_seconds(h.step_quantile(0.5))}, p95 {fmt_seconds(h.step_quantile(0.95))}",
        "  " + nonfinite_line(h),
        *(["  " + spikes] if (spikes := spike_line(h)) is not None else []),
        *(["  " + replays] if (replays := replay_line(h)) is not None else []),
        *(["  " + verdicts] if (verdicts := spike_replay_line(h)) is not None else []),
        "  top layers by share of step time: "
        + (", ".join(f"{r.layer} {fmt_share(r.share)}" for r in top) if top else "none timed"),
    ]
    return "\n".join(lines)


def say(text: str) -> None:
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)
