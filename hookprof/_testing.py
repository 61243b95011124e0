"""The seam tests and benchmarks use to look inside a live profiler.

Everything here reads (or, where a test must, swaps) a part of hookprof that is not public.
Tests and bench/ call these functions instead of reaching into private attributes, so the
parts can change their insides without breaking every test: when a part moves, the one
function here that finds it moves with it. Not for users; nothing here is stable.

The readers return what they find. The seams (`*_seam`) return (owner, attribute name) of
something a test replaces, for `monkeypatch.setattr(*seam(), replacement)` or a
getattr/setattr pair that puts the original back.
"""

from __future__ import annotations

from typing import Any

from hookprof.profiler import Profiler

# -- a profiler's parts ----------------------------------------------------------------------


def step_is_sampled(prof: Profiler) -> bool:
    """Is the step now in progress (or about to begin) a sampled one?"""
    return prof._sampled.plan.sampled


def step_record(prof: Profiler) -> Any:
    """The StepRecord the sampled step in progress writes (its calls, marks and gradient
    events); None on an unsampled step."""
    return prof._sampled.record


def hook_owner(prof: Profiler) -> Any:
    """The object whose bound methods are the profiler's hooks on the model's modules (the
    root's, and its children's entry hooks): its StepBoundary."""
    return prof._boundary


def replaying(prof: Profiler) -> bool:
    """Is a forward running now hookprof's replay of a step (to find a NaN's producer)?"""
    return prof._hooks.replaying


def counter_drain_seam(prof: Profiler) -> tuple[Any, str]:
    """What flush() calls to bring the device's NaN counters over to the host (through
    the step events' `drain`, which decides the pending updates' capsules first)."""
    return prof._events, "_drain"


def live_profilers() -> list[Any]:
    """Every profiler attached in this process and not yet detached."""
    from hookprof import live

    return live.profilers()


# -- the endpoint ----------------------------------------------------------------------------


def metrics_server(prof: Profiler) -> Any:
    """The MetricsServer of the endpoint this profiler serves on (None when not serving)."""
    return prof._serving.server


def metrics_page(prof: Profiler) -> Any:
    """The endpoint's cached /metrics page (it counts its renders)."""
    return prof._serving.server.page


def http_server(prof: Profiler) -> Any:
    """The HTTP server (serve.httpd.Server) behind the profiler's endpoint now: its listening
    `socket`, `server_address`, whether it was inherited by a fork (`forked`), `shutdown()`."""
    return prof._serving.server._server


def serving_thread(prof: Profiler) -> Any:
    """The thread that runs the profiler's HTTP server now."""
    return prof._serving.server._thread


def open_connections(server: Any) -> set:
    """The client sockets an httpd.Server holds open now."""
    return server._open


def settle_would_wait(publisher: Any) -> bool:
    """Would Publisher.settle fold a packet whose copy has not completed, asked of each
    copy's own event (settle folds the oldest packets while `ready()` says so; a test may
    make that lie by replacing transfer.is_ready)?"""
    with publisher._in_flight_lock:
        batches = list(publisher._in_flight)
    for batch in batches:
        if batch is None:
            continue
        if not batch.ready():
            return False
        if any(ready is not None and not ready.query() for _, ready in batch._sent.values()):
            return True
    return False


def unfinished_copies(publisher: Any) -> int:
    """How many device-to-host copies of the packets a Publisher has been given and not
    folded yet have not completed, asked of each copy's own event (not transfer.is_ready,
    which a test may replace): what a flush on the training thread would wait for."""
    with publisher._in_flight_lock:
        batches = list(publisher._in_flight)
    return sum(
        1
        for batch in batches
        if batch is not None
        for _, ready in batch._sent.values()
        if ready is not None and not ready.query()
    )


# -- device timing -------------------------------------------------------------------------------


def device_copy_seam() -> tuple[Any, str]:
    """What starts every device-to-host copy hookprof makes (one-value peeks, counter drains,
    sampled batches): returns (host tensor, ready event). The emulated device and the sync
    watch replace it."""
    from hookprof.device import transfer

    return transfer, "_start_copy"


def pooled_events(timer: Any) -> list:
    """The events a CudaEventTimer holds for reuse (each released after its step)."""
    return list(timer._pool)


def current_stream_seam(timer: Any) -> tuple[Any, str]:
    """What a CudaEventTimer calls to find the training thread's current stream."""
    return timer, "_current_stream"


def known_streams(lookup: Any) -> dict:
    """The streams a StreamLookup has cached, by what identifies them."""
    return lookup._known


# -- parts of a sampled step -----------------------------------------------------------------


def next_update_norm_turn(norms: Any) -> list[int]:
    """The layers (indices) whose updates UpdateNorms measures next; takes that turn."""
    return norms._turn()


def held_parameter_copies(norms: Any) -> list:
    """The (parameter index, copy before the update) pairs UpdateNorms holds now; [] when none."""
    return list(norms._before or ())


def update_norm_grouping_seam() -> tuple[Any, str]:
    """UpdateNorms' method that groups the parameters into turns (run when the optimizer's
    parameter groups change)."""
    from hookprof.efficiency.updates import UpdateNorms

    return UpdateNorms, "_group"


def flop_key_seam() -> tuple[Any, str]:
    """The function the FLOP counter keys a layer call's arguments with."""
    from hookprof.efficiency import flops

    return flops, "_key"


def step_end_seam() -> tuple[Any, str]:
    """IncidentResponse's method that each step's end calls before the next step is planned
    (its layer hooks put in): where a test holds a step end to race detach() against it."""
    from hookprof.nonfinite.incident import IncidentResponse

    return IncidentResponse, "at_step_end"


def replay_run_seam() -> tuple[Any, str]:
    """ForwardReplay's method that re-runs a kept step's forward."""
    from hookprof.nonfinite.replay import ForwardReplay

    return ForwardReplay, "_run"


# -- stalls and the exit summary -----------------------------------------------------------


def typical_phase_seconds(watch: Any, phase: int) -> Any:
    """The window of recent durations of `phase` a StallWatch judges "typical" from (a deque
    a test may add to)."""
    return watch._typical[phase]


def summary_registered() -> bool:
    """Is the at-exit summary registered with atexit now (live.py)?"""
    from hookprof import live

    return live.at_exit_watched()[0]


def summary_watched() -> list[Any]:
    """The profilers the at-exit summary will speak of (live.py)."""
    from hookprof import live

    return live.at_exit_watched()[1]


# --- used by bench/ ---


def step_boundary_methods() -> tuple[type, tuple[str, ...]]:
    """The class whose methods the training thread runs at a step's boundaries (the root's
    forward begins, its output arrives, the optimizer's pre and post hooks, prof.step: the
    StepBoundary) and their names: bench/host_cost.py wraps them on the class, before attach() binds them as
    hooks, to time and count an unsampled step's host work."""
    from hookprof.step.boundary import StepBoundary

    return StepBoundary, (
        "_on_root_forward",
        "_on_root_output",
        "_on_optimizer_pre",
        "_on_optimizer_post",
        "step",
    )


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


def forget_capsules_written() -> None:
    """Start the process's count of incident capsules again (Config.capsule_max_count is per
    process: tests of one process would share it)."""
    from hookprof.nonfinite import capsule

    capsule.forget_written()
