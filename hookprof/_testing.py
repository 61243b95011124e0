"""The seam tests and benchmarks use to look inside a live profiler.

Everything here reads (or, where a test must, swaps) a part of hookprof that is not public.
Tests and bench/ call these functions instead of reaching into private attributes, so the
parts can change their insides without breaking every test: when a part moves, the one
function here that finds it moves with it. Not for users; nothing here is stable.
"""

from __future__ import annotations

from typing import Any

from hookprof.profiler import Profiler


def step_is_sampled(prof: Profiler) -> bool:
    """Is the step now in progress (or about to begin) a sampled one?"""
    return prof._sampled.plan.sampled


def metrics_server(prof: Profiler) -> Any:
    """The MetricsServer of the endpoint this profiler serves on (None when not serving)."""
    return prof._serving.server


def metrics_page(prof: Profiler) -> Any:
    """The endpoint's cached /metrics page (it counts its renders)."""
    return prof._serving.server.page


def live_profilers() -> list[Profiler]:
    """The profilers of this process not yet detached (live.py's registry)."""
    from hookprof import live

    return live.profilers()
