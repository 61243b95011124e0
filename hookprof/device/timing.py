"""Timestamps taken inside hooks and resolved later, off the training thread.

Both timers share one interface: `mark()` is called in a hook and returns a token at once;
`seconds(ref, token)` is called by the publisher thread and may wait for the device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from hookprof.device import streams


class Timer(Protocol):
    """What hooks and the publisher need of a clock."""

    kind: str
    yield_gil: Callable[[], None]  # the publisher calls it between stretches of its Python

    def start(self) -> Any:
        """The first token of a sampled step (training thread): as mark(), and the moment a
        timer may fix per-step state (the CUDA stream its marks are recorded on)."""

    def mark(self) -> Any:
        """A timestamp token, taken at once (any thread, never waits)."""

    def seconds(self, ref: Any, token: Any) -> float:
        """Seconds from `ref` to `token`; may wait for the device (publisher thread only)."""

    def resolve(self, ref: Any, tokens: Iterable[Any]) -> dict[Any, float]:
        """{token: seconds from `ref`} for every token of one step: what the publisher
        calls; may wait for the device, once."""

    def release(self, tokens: Iterable[Any]) -> None:
        """Tokens that are no longer needed (pooled events go back)."""


def _yield_gil() -> None:
    time.sleep(0)  # releases the GIL: a waiting training thread runs before we go on


class CpuTimer:
    """Host clock. `time.perf_counter_ns` costs ~0.06 us and never waits for anything."""

    kind = "cpu"

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns):
        # mark() is the clock itself, not a method calling it: one frame less per mark
        self.mark: Callable[[], int] = clock
        self.yield_gil = _yield_gil

    def start(self) -> int:
        return self.mark()

    def seconds(self, ref: int, token: int) -> float:
        return (token - ref) * 1e-9

    def resolve(self, ref: int, tokens: Iterable[int]) -> dict[int, float]:
        return {t: (t - ref) * 1e-9 for t in tokens}

    def release(self, tokens: Iterable[Any]) -> None:
        pass


# events resolved between two GIL releases: real CUDA events cost ~6 us each to resolve
# (measured on an H200, torch 2.11, 2026-11-27: 256 of them held the GIL 1.56 ms, over the
# 1 ms target); 64 keep a stretch near 0.4 ms there
RESOLVE_CHUNK = 64


class CudaEventTimer:
    """Device clock: pooled `torch.cuda.Event(enable_timing=True)` recorded on the stream
    that was current when the sampled step began. Recording is asynchronous; only
    `resolve()`/`seconds()` (publisher thread) wait on an event.

    Host cost is what matters on a GPU (issue 13): on an H100 `Event.record()` without a
    stream cost 9.8 us, most of it `torch.cuda.current_stream()` (7.5 us), and 2.9 us with
    a stream passed (2026-11-22). So the stream is looked up once per sampled step, in
    start(), and every mark records on it through the C method (one Python frame less than
    `Event.record(stream)`; not yet measured on a GPU). A loop that switches streams inside a step
    (`with torch.cuda.stream(s)`
    around part of the forward) gets that part timed on the step's first stream: the times
    are then those of the first stream's progress, never an error or a wait.

    `event_factory` and `current_stream` exist so the logic can be tested without a GPU.
    """

    kind = "cuda"

    def __init__(
        self,
        event_factory: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
        yield_gil: Callable[[], None] = _yield_gil,
    ):
        if event_factory is None:
            self._new_event: Callable[[], Any] = lambda: torch.cuda.Event(enable_timing=True)
            # the C method itself: torch.cuda.Event.record(stream) is a Python frame around it
            self._record: Callable[[Any, Any], None] = torch._C._CudaEventBase.record
        else:
            self._new_event = event_factory
            self._record = lambda event, stream: event.record(stream)
        self._current_stream = current_stream or streams.current_stream
        self.yield_gil = yield_gil
        self._stream: Any = None
        self._last: Any = None  # the event recorded last (see resolve)
        self._pool: deque[Any] = deque()  # deque.append/pop are atomic: hooks on any thread
        self.created = 0

    def start(self) -> Any:
        # the training thread's current stream, once per sampled step (~7.5 us on an H100)
        self._stream = self._current_stream()
        return self.mark()

    def mark(self) -> Any:
        try:
            event = self._pool.pop()
        except IndexError:
            event = self._new_event()
            self.created += 1
        stream = self._stream
        self._record(event, stream if stream is not None else self._current_stream())
        self._last = event
        return event

    def seconds(self, ref: Any, token: Any) -> float:
        # note: waits for the device, but only ever on the publisher thread
        token.synchronize()
        return ref.elapsed_time(token) * 1e-3

    def resolve(self, ref: Any, tokens: Iterable[Any]) -> dict[Any, float]:
        """One wait for the whole step, not one per event: the marks of a step are recorded
        on one stream, in order, so once the event recorded last (this step's or a later
        one's) has completed, so has every earlier one. An event that is not complete after
        all (a mark raced another thread's, a stream switched between steps) raises in
        elapsed_time and is waited for on its own. The GIL is released every RESOLVE_CHUNK
        events so that the training thread never waits long for it."""
        last = self._last
        if last is not None:
            # note: waits for the device, but only ever on the publisher thread
            last.synchronize()
        elapsed = ref.elapsed_time
        out: dict[Any, float] = {}
        for k, token in enumerate(tokens):
            if k % RESOLVE_CHUNK == RESOLVE_CHUNK - 1:
                self.yield_gil()
            try:
                out[token] = elapsed(token) * 1e-3
            except RuntimeError:  # not complete yet: this one waits on its own
                token.synchronize()
                ref.synchronize()
                out[token] = elapsed(token) * 1e-3
        return out

    def release(self, tokens: Iterable[Any]) -> None:
        self._pool.extend(tokens)


def timer_for(devices: set[torch.device]) -> CpuTimer | CudaEventTimer:
    """CUDA events when the model lives on CUDA, the host clock otherwise."""
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_available():
        return CudaEventTimer()
    return CpuTimer()
