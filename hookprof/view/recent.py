"""`hookprof top`'s line of recent steps (issue 41): the last steps' loss and global gradient
norm as one character each, so that the run up to an incident shows in the terminal step by
step, not only the last sampled value.

Read from /history.json?recent (serve/server.py: a few KB, made at most once a second). A
value is one of eight heights from the finite values' minimum to their maximum (a log scale
when they span more than 1000x and are positive); a non-finite value is `!`, a step without
one (no loss given) is a space."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hookprof.view.table import fmt_num

LEVELS = "▁▂▃▄▅▆▇█"
NONFINITE = "!"
WIDTH = 60  # steps drawn at most


def spark(values: Sequence[float | None]) -> str:
    """One character per value (see the module's docstring)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "".join(" " if v is None else NONFINITE for v in values)
    lo, hi = min(finite), max(finite)
    log = lo > 0 and hi / lo > 1e3

    def level(v: float) -> str:
        a, b, x = (math.log10(lo), math.log10(hi), math.log10(v)) if log else (lo, hi, v)
        if b <= a:
            return LEVELS[len(LEVELS) // 2]
        return LEVELS[min(int((x - a) / (b - a) * len(LEVELS)), len(LEVELS) - 1)]

    return "".join(
        " " if v is None else level(v) if math.isfinite(v) else NONFINITE for v in values
    )


def recent_line(
    recent: dict[str, Any] | None, width: int = WIDTH, label: str = "steps"
) -> str | None:
    """`top`'s line for one run: the last `width` steps' loss and gradient norm, each with
    its last value and range; None without any (an endpoint of an older hookprof)."""
    if not recent or not recent.get("step"):
        return None
    steps = recent["step"][-width:]
    parts = [f"{label} {int(steps[0]):,}-{int(steps[-1]):,}:"]
    for name, col in (("loss", "loss"), ("grad norm", "grad_norm")):
        values = recent[col][-width:]
        if all(v is None for v in values):
            continue
        finite = [v for v in values if v is not None and math.isfinite(v)]
        bad = sum(1 for v in values if v is not None and not math.isfinite(v))
        last = next((v for v in reversed(values) if v is not None), None)
        last_text = "NaN/Inf" if last is not None and not math.isfinite(last) else fmt_num(last)
        span = f" {fmt_num(min(finite))}..{fmt_num(max(finite))}" if finite else ""
        parts.append(
            f"{name} [{spark(values)}] last {last_text}{span}"
            + (f" ({bad} non-finite)" if bad else "")
        )
    return "  ".join(parts) if len(parts) > 1 else None


def recent_lines(doc: dict[str, Any], width: int = WIDTH) -> str | None:
    """The run's recent steps and, once a step went non-finite, the steps up to it (which
    the recent ones no longer show once the run went on), one line each."""
    lines = [recent_line(doc.get("recent"), width)]
    lead_up = doc.get("lead_up")
    recent_steps = (doc.get("recent") or {}).get("step") or [math.inf]
    first_drawn = recent_steps[-width:][0]  # (the line draws the last `width` of them)
    if lead_up and lead_up.get("step") and lead_up["step"][-1] < first_drawn:
        lines.append(recent_line(lead_up, width, label="up to the first NaN/Inf: steps"))
    shown = [line for line in lines if line is not None]
    return "\n  ".join(shown) if shown else None
