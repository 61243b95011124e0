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


class Timer(Protocol):
    """What hooks and the publisher need of a clock."""

    kind: str

    def mark(self) -> Any:
        """A timestamp token, taken at once (any thread, never waits)."""

    def seconds(self, ref: Any, token: Any) -> float:
        """Seconds from `ref` to `token`; may wait for the device (publisher thread only)."""

    def release(self, tokens: Iterable[Any]) -> None:
        """Tokens that are no longer needed (pooled events go back)."""


class CpuTimer:
    """Host clock. `time.perf_counter_ns` costs ~0.06 us and never waits for anything."""

    kind = "cpu"

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns):
        # mark() is the clock itself, not a method calling it: one frame less per mark
        self.mark: Callable[[], int] = clock

    def seconds(self, ref: int, token: int) -> float:
        return (token - ref) * 1e-9

    def release(self, tokens: Iterable[Any]) -> None:
        pass


class CudaEventTimer:
    """Device clock: pooled `torch.cuda.Event(enable_timing=True)` recorded on the current
    stream. Recording is asynchronous; only `seconds()` (publisher thread) waits on an event.

    `event_factory` exists so the pooling logic can be tested without a GPU.
    """

    kind = "cuda"

    def __init__(self, event_factory: Callable[[], Any] | None = None):
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._pool: deque[Any] = deque()  # deque.append/pop are atomic: hooks on any thread
        self.created = 0

    def mark(self) -> Any:
        try:
            event = self._pool.pop()
        except IndexError:
            event = self._new_event()
            self.created += 1
        event.record()
        return event

    def seconds(self, ref: Any, token: Any) -> float:
        # note: waits for the device, but only ever on the publisher thread
        token.synchronize()
        return ref.elapsed_time(token) * 1e-3

    def release(self, tokens: Iterable[Any]) -> None:
        self._pool.extend(tokens)


def timer_for(devices: set[torch.device]) -> CpuTimer | CudaEventTimer:
    """CUDA events when the model lives on CUDA, the host clock otherwise."""
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_available():
        return CudaEventTimer()
    return CpuTimer()
