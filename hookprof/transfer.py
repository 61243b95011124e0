"""The one place where hookprof moves data from the device to the host.

Every sampled step concatenates its scalars into one tensor per device and calls
`to_host` once for it; tests count the calls through `transfer_count()`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

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


def _start_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if t.device.type == "cpu":
        return t, None
    if t.device.type != "cuda":
        # other accelerators: a plain blocking copy
        return t.to("cpu"), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
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


def wait_ready(ready: Any) -> None:
    # note: a CPU-GPU sync point, and the only one: it runs on the publisher thread
    if ready is not None:
        ready.synchronize()


def is_ready(ready: Any) -> bool:
    """Has a copy started by to_host completed? Never waits."""
    return ready is None or ready.query()


def peek(flag: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start reading one small device value without waiting: on the CPU the tensor itself
    (readable at once), on CUDA a non-blocking copy to pinned memory plus its event. Used for
    the per-step forward check, so a NaN can be localised before the optimizer step, and by
    the on_nonfinite policies; not counted with the per-sampled-step batches."""
    return _start_copy(flag)
