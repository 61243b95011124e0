"""The stall watch: a small daemon thread that judges, from the progress record alone, whether
the training thread is stuck, and on a stall reads once where it is.

Per phase it learns the typical duration: the median of that phase's share of recent steps
(sampled at each poll, so a fast loop is sub-sampled). A phase lasting more than
`stall_factor` x typical, bounded below by `stall_min_s` and above by `stall_max_s`, after
`stall_warmup_steps` completed steps, is a stall. Once per stall: the training thread's Python
stack (`sys._current_frames()`), the innermost module of the model on it (matching `self` in
the frames against the model's modules), what it waits on, and, under torch.distributed, the
rank's last collectives from torch's flight recorder; one log block; the report goes into the
snapshot. Nothing here runs on the training thread.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import nn

from hookprof.faults import DaemonThread, Faults, log
from hookprof.layers import ROOT_NAME
from hookprof.phases.clock import OUTSIDE, PHASES, Progress, phase_name
from hookprof.snapshot import Snapshot, StallReport, StepProgress

UNKNOWN_LAYER = "(unknown)"
WINDOW = 32  # steps whose phases make the typical durations
LAST_COLLECTIVES = 4
MAX_STACK = 40  # frames kept in a report, innermost ones

# frames that say what the thread waits on ("/" separated path fragments)
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/_functional_collectives",
    "torch/nn/parallel/distributed.py",
)
_DATA_FILES = ("torch/utils/data/",)
# known long work that is not a stall of the step: a checkpoint save or load, a (re)compile
_EXCUSED_FILES = {
    "torch/serialization.py": "checkpoint",
    "torch/distributed/checkpoint/": "checkpoint",
    "torch/_dynamo/": "compile",
    "torch/_inductor/": "compile",
}


class StallWatch(DaemonThread):
    """Watches one profiler's Progress. `check()` is one poll (the thread calls it every
    `interval_s`; tests may call it with their own clock reading)."""

    @classmethod
    def from_config(
        cls,
        progress: Progress,
        model: nn.Module,
        config: Any,
        *,
        faults: Faults,
        rank: int,
        model_name: str,
        clock: Callable[[], int],
        wall_clock: Callable[[], float],
        device_busy: Callable[[], bool],
    ) -> StallWatch:
        """The watch with its slice of the config (stall_factor, stall_min_s, stall_max_s,
        stall_warmup_steps)."""
        return cls(
            progress,
            model,
            factor=config.stall_factor,
            min_s=config.stall_min_s,
            max_s=config.stall_max_s,
            warmup_steps=config.stall_warmup_steps,
            faults=faults,
            rank=rank,
            model_name=model_name,
            clock=clock,
            wall_clock=wall_clock,
            device_busy=device_busy,
            name=f"hookprof-stall-watch-rank{rank}",
        )

    def __init__(
        self,
        progress: Progress,
        model: nn.Module,
        *,
        factor: float,
        min_s: float,
        max_s: float,
        warmup_steps: int,
        faults: Faults,
        rank: int,
        model_name: str,
        clock: Callable[[], int] = time.perf_counter_ns,
        wall_clock: Callable[[], float] = time.time,
        device_busy: Callable[[], bool] = lambda: False,
        name: str = "hookprof-stall-watch",
    ):
        self._progress = progress
        # id(module) -> qualified name: ids only, the watch keeps no module alive
        self._module_names = {id(m): name or ROOT_NAME for name, m in model.named_modules()}
        self._factor, self._min_s, self._max_s = factor, min_s, max_s
        self._warmup = warmup_steps
        self._faults = faults
        self._rank, self._model_name = rank, model_name
        self._clock, self._wall_clock = clock, wall_clock
        self._device_busy = device_busy
        self.interval_s = max(0.02, min(1.0, min_s / 4))
        self.training_thread = threading.get_ident()  # set again at the first training forward
        self._typical: list[deque[float]] = [deque(maxlen=WINDOW) for _ in PHASES]
        self._learned_step = 0
        self._judged: tuple[int, int, int] | None = None  # (step, phase, since) of the stall
        self.stall: StallReport | None = None
        self.stalls = 0
        self._stop = threading.Event()
        DaemonThread.__init__(self, name)

    def follow(self, thread_id: int) -> None:
        """The training thread is this one (it ran the first training forward)."""
        self.training_thread = thread_id

    # ---- the thread ----

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # never die: a missed poll is better than no watch
                self._faults.report("stall watch", exc, disable=False)

    # ---- one poll ----

    def threshold(self, phase: int) -> float | None:
        """Seconds a phase may last before it is a stall; None while nothing is learned."""
        seen = self._typical[phase]
        if not seen:
            return None
        return min(max(self._factor * statistics.median(seen), self._min_s), self._max_s)

    def check(self, now_ns: int | None = None) -> StallReport | None:
        self._learn()
        step, phase, since, _ = self._progress.where
        now_ns = self._clock() if now_ns is None else now_ns
        key = (step, phase, since)
        if self._judged is not None and self._judged != key:
            self._resolved(now_ns)
        if self._judged == key or phase == OUTSIDE or step - 1 < self._warmup:
            return self.stall
        limit = self.threshold(phase)
        elapsed = (now_ns - since) * 1e-9
        if limit is None or elapsed <= limit:
            return None
        frames = _stack_of(self.training_thread)
        if elapsed <= self._max_s and _excused(frames):
            return (
                None  # known long work: judged against the ceiling alone, looked at again next poll
            )
        self._judged = key
        self.stalls += 1
        self.stall = self._report(step, phase, elapsed, limit, frames)
        log.warning(self._describe(self.stall))
        return self.stall

    def _learn(self) -> None:
        last = self._progress.last_step
        if last is None or last[0] == self._learned_step:
            return
        self._learned_step = last[0]
        for seen, seconds in zip(self._typical, last[1]):
            seen.append(seconds)

    def _resolved(self, now_ns: int) -> None:
        stall = self.stall
        self._judged, self.stall = None, None
        if stall is not None:
            log.warning(
                "hookprof: rank %s model %s: the %s of step %d went on after %.1f s",
                self._rank,
                self._model_name,
                stall.phase,
                stall.step,
                self._wall_clock() - stall.started_at,
            )

    def _report(
        self, step: int, phase: int, elapsed: float, limit: float, frames: list[Any]
    ) -> StallReport:
        layer = self._innermost_module(frames)
        collectives = last_collectives()
        return StallReport(
            step=step,
            phase=phase_name(phase),
            layer=layer,
            waiting_on=self._waiting_on(frames, collectives),
            seconds=elapsed,
            threshold_seconds=limit,
            typical_seconds=statistics.median(self._typical[phase]),
            started_at=self._wall_clock() - elapsed,
            stack=tuple(_describe_frame(f) for f in reversed(frames[:MAX_STACK])),
            collectives=tuple(c[0] for c in collectives),
        )

    def _innermost_module(self, frames: list[Any]) -> str:
        for frame in frames:  # innermost first
            name = self._module_of(frame)
            if name is not None:
                return name
        return UNKNOWN_LAYER

    def _module_of(self, frame: Any) -> str | None:
        """The model's module whose method this frame runs, if any."""
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            return self._module_names.get(id(frame.f_locals.get("self")))
        return None

    def _waiting_on(self, frames: list[Any], collectives: list[tuple[str, bool]]) -> str:
        # only the frames inside the innermost module call (or all, outside the model) say
        # what the thread waits on: DDP's forward is on the stack of every step's forward
        inner = []
        for frame in frames:
            if self._module_of(frame) is not None:
                break
            inner.append(frame)
        files = [f.f_code.co_filename.replace(os.sep, "/") for f in inner]
        if any(in_flight for _, in_flight in collectives) or _any_in(files, _COLLECTIVE_FILES):
            return "collective"
        if _any_in(files, _DATA_FILES):
            return "data"
        try:
            if self._device_busy():
                return "device"
        except Exception:  # a device that cannot be asked: say nothing of it
            pass
        return "code"

    def _describe(self, stall: StallReport) -> str:
        lines = [
            f"hookprof: rank {self._rank} model {self._model_name} stalled in the {stall.phase} of "
            f"step {stall.step}: {stall.seconds:.1f} s so far (typical {stall.typical_seconds:.3g} s, "
            f"threshold {stall.threshold_seconds:.3g} s); innermost layer: {stall.layer}; "
            f"waiting on: {stall.waiting_on}",
        ]
        if stall.collectives:
            lines.append("  last collectives (flight recorder): " + "; ".join(stall.collectives))
        lines.append("  training thread stack (most recent call last):")
        for entry in stall.stack:
            lines.append(f"    {entry}")
        return "\n".join(lines)

    # ---- what the snapshot shows ----

    def decorate(self, snap: Snapshot) -> Snapshot:
        """The publisher's snapshot with the phase totals, the position, the stall and the
        model's name."""
        step, phase, since, label = self._progress.where
        steps, sums = self._progress.totals
        position = StepProgress(
            step, phase_name(phase), max(0.0, (self._clock() - since) * 1e-9), label
        )
        # a stall is shown while its phase lasts, even before the next poll clears it
        judged, stall = self._judged, self.stall
        current = judged == (step, phase, since)
        return dataclasses.replace(
            snap,
            phase_seconds=dict(zip(PHASES, sums)),
            phase_steps=steps,
            progress=position,
            stall=stall if current else None,
            stalls=self.stalls,
            model=self._model_name,
        )


def _stack_of(thread_id: int) -> list[Any]:
    """The thread's frames, innermost first ([] when it is gone)."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _any_in(files: list[str], fragments: tuple[str, ...]) -> bool:
    return any(fragment in f for f in files for fragment in fragments)


def _excused(frames: list[Any]) -> str | None:
    """What known long work is on the stack: a checkpoint, a compile, or a DataLoader's
    first batch of an epoch (workers starting, datasets opening: `_num_yielded` is 0)."""
    for frame in frames:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for fragment, what in _EXCUSED_FILES.items():
            if fragment in path:
                return what
        if "torch/utils/data/dataloader.py" in path and frame.f_code.co_varnames[:1] == ("self",):
            if getattr(frame.f_locals.get("self"), "_num_yielded", None) == 0:
                return "epoch start"
    return None


def _describe_frame(frame: Any) -> str:
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    return f"{where}: {line}" if line else where


def last_collectives(limit: int = LAST_COLLECTIVES) -> list[tuple[str, bool]]:
    """("seq N op state", in flight) of this rank's last collectives, from torch's flight
    recorder (on when TORCH_FR_BUFFER_SIZE, or TORCH_NCCL_TRACE_BUFFER_SIZE, is > 0); [] when
    torch.distributed is not initialised, the recorder is off, or this torch lacks the API."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None) or c10d._dump_nccl_trace_json  # type: ignore[attr-defined]
        entries = json.loads(dump(includeCollectives=True, onlyActive=False)).get("entries", [])
    except Exception:
        return []
    out = []
    for entry in entries[-limit:]:
        # gloo leaves every entry "scheduled" and marks completion by retiring it; NCCL also
        # moves its state to "completed"
        in_flight = not entry.get("retired", False) and entry.get("state") != "completed"
        out.append(
            (
                f"seq {entry.get('collective_seq_id')} {entry.get('profiling_name')} "
                f"{entry.get('state')}{' (in flight)' if in_flight else ''}",
                in_flight,
            )
        )
    return out


def cuda_busy(devices: set[Any]) -> Callable[[], bool]:
    """Whether any of the model's CUDA devices still has work queued on its default stream
    (a non-blocking query)."""
    import torch

    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if not cuda:
        return lambda: False
    return lambda: any(not torch.cuda.default_stream(i).query() for i in cuda)
