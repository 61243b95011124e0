"""Every movement of data between the device and the host: one batched copy per sampled step.

A sampled step gathers its device scalars in a ScalarBatch, which concatenates them into one
tensor per device and calls `to_host` once for each (tests count the calls through
`transfer_count()`); the publisher thread waits on the HostBatch and reads values by key.
Small one-value peeks (the per-step output check) and host-to-device index copies live here
too, each without a sync on the training thread.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

from hookprof.device.streams import current_stream

_calls = itertools.count()  # next() is atomic under the GIL
_taken = 0


def transfer_count() -> int:
    """How many device-to-host transfers hookprof has started in this process."""
    return _taken


def to_host(flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying `flat` to the host without waiting. Returns (host tensor, ready event).

    The caller hands both to the publisher thread, which waits on the event (None: the data
    is already on the host) before reading the host tensor.
    """
    global _taken
    _taken = next(_calls) + 1
    return _start_copy(flat)


def on_host(t: torch.Tensor) -> bool:
    """Can `t` be read without waiting for a device? (CPU tensors.) The one place that says
    so: tests replace it to run the accelerator code paths on the CPU, with a device that
    runs steps behind the host (tests/support/lagging_device.py)."""
    return t.device.type == "cpu"


def _start_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if t.device.type == "cpu":
        return t, None
    if t.device.type != "cuda":
        # other accelerators: a plain blocking copy
        return t.to("cpu"), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    # on the stream the copy was issued on: the current one of the tensor's device (not of
    # the current device), passed rather than looked up by record() (~7 us less on an H100)
    ready.record(current_stream(t.device.index))
    return host, ready


def index_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device`, without a sync: `torch.tensor(values,
    device=cuda)` copies from pageable memory, which waits for the device (caught by
    set_sync_debug_mode("error") on an H100); a pinned buffer copies asynchronously, and the
    caching host allocator keeps it until the copy has run."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def floats_to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """A float64 tensor of `values` on `device`, without a sync (as `index_to_device`)."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def wait_ready(ready: Any) -> None:
    # note: a CPU-GPU sync point. It runs on the publisher thread, and on the training thread
    # only with the opt-in Config.nonfinite_sync, once per optimizer update (a plain loop: once
    # per step; each closure evaluation under skip/raise): the guard's read_now() of
    # the step's flags (guard.py), or else the replay's output flag at the optimizer hook
    if ready is not None:
        ready.synchronize()


def read_now(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, waited for: the opt-in Config.nonfinite_sync's read of a flag still on
    the device (guard.py). Through _start_copy and wait_ready, like every other read, so that
    the lagging-device emulation sees the wait (a bare `bool(t)` it could not)."""
    host, ready = _start_copy(t)
    wait_ready(ready)  # note: a CPU-GPU sync point (opt-in)
    return host


def is_ready(ready: Any) -> bool:
    """Has a copy started by to_host completed? Never waits."""
    return ready is None or ready.query()


class Copy(NamedTuple):
    """A value on its way to the host: `host`, readable once `ready` (the copy's event)
    says so, or at once when `ready` is None (a CPU tensor, or a value known on the host)."""

    host: Any
    ready: Any


def peek(flag: torch.Tensor) -> Copy:
    """Start reading one small device value without waiting: on the CPU the tensor itself
    (readable at once), on CUDA a non-blocking copy to pinned memory plus its event. Used for
    the per-step forward check, so a NaN can be localised before the optimizer step, and by
    the on_nonfinite policies; not counted with the per-sampled-step batches."""
    host, ready = _start_copy(flag)  # (the seam tests replace may return a plain pair)
    return Copy(host, ready)


class ScalarBatch:
    """Named groups of device scalars, concatenated per device and sent to the host with one
    `transfer.to_host` call per device (one in all for a single-device model)."""

    def __init__(self) -> None:
        self._parts: dict[torch.device, list[torch.Tensor]] = {}
        self._sizes: dict[torch.device, int] = {}
        self._where: dict[Any, list[tuple[torch.device, int, int]]] = {}

    def add(self, key: Any, values: torch.Tensor) -> None:
        """Append a 0-d or 1-d tensor under `key` (a key may collect several tensors)."""
        flat = values.reshape(-1)
        device = flat.device
        offset = self._sizes.get(device, 0)
        self._parts.setdefault(device, []).append(flat)
        self._sizes[device] = offset + flat.numel()
        self._where.setdefault(key, []).append((device, offset, flat.numel()))

    def send(self) -> HostBatch:
        sent = {}
        for device, parts in self._parts.items():
            # into float64, which holds int64 counts and low-precision floats exactly: cat's
            # own promotion would not (bfloat16 parts and int64 counts promote to bfloat16,
            # which rounds a count above 256)
            flat = torch.cat(
                parts, out=torch.empty(self._sizes[device], dtype=torch.float64, device=device)
            )
            sent[device] = to_host(flat)
        return HostBatch(self._where, sent)


class HostBatch:
    """The host side: wait once, then look the values up by key."""

    def __init__(self, where: dict[Any, list[tuple[torch.device, int, int]]], sent: dict):
        self._where = where
        self._sent = sent
        self._lists: dict[torch.device, list[float]] | None = None

    def ready(self) -> bool:
        """Have its copies completed (so reading it waits for no device)?"""
        return self._lists is not None or all(is_ready(ready) for _, ready in self._sent.values())

    def wait(self) -> None:
        if self._lists is None:
            for _, ready in self._sent.values():
                wait_ready(ready)
            # host tensors only (the copy above has completed): no device is touched here
            self._lists = {d: host.tolist() for d, (host, _) in self._sent.items()}

    def get(self, key: Any) -> list[float]:
        self.wait()
        assert self._lists is not None
        out: list[float] = []
        for device, offset, n in self._where.get(key, ()):
            out.extend(self._lists[device][offset : offset + n])
        return out
