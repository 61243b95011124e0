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


# --- used by bench/ ---


def step_boundary_methods() -> tuple[type, tuple[str, ...]]:
    """The class whose methods the training thread runs at a step's boundaries (the root's
    forward begins, its output arrives, the optimizer's pre and post hooks, prof.step: the
    StepBoundary) and their names: bench/host_cost.py wraps them on the class, before attach() binds them as
    hooks, to time and count an unsampled step's host work."""
    from hookprof.step.boundary import StepBoundary

    return StepBoundary, ("_on_root_forward", "_on_root_output", "_on_optimizer_pre",
                          "_on_optimizer_post", "step")


def timing_resolution_method() -> tuple[type, str]:
    """The publisher's method that turns one sampled step's timer marks into times, and its
    class: bench/host_cost.py wraps it to time how long the publisher holds the GIL."""
    from hookprof.publish.aggregate import Aggregator

    return Aggregator, "_resolve_times"


def layer_call(hooks: Any) -> tuple[Any, Any]:
    """(start, end) of one layer call, as the forward wrapper calls them on `hooks` (a
    LayerHooks): start(layer, args, kwargs) says whether the call is recorded, and
    end(layer, output) closes a recorded one."""
    return hooks._enter, hooks._end


def flop_arguments(*tensors: Any) -> tuple:
    """The arguments efficiency.flops.count takes for forward(*tensors): each tensor by its
    description (shape, dtype, requires_grad), as the FLOP counter keeps them."""
    from hookprof.efficiency.flops import _Meta

    return tuple(_Meta(t) for t in tensors)


def peak_lookup(efficiency: Any, precision: str) -> Any:
    """The peak lookup a StepEfficiency makes at a sampled step's end (a callable), as after
    a forward that ran in `precision` ("bf16", "fp32", ...)."""
    efficiency._precision = precision
    return efficiency._peak
