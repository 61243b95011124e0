"""A CPU stand-in for an accelerator that runs `lag` optimizer steps behind the host.

On a GPU the training thread queues work and moves on: a one-value copy started at step N
has not completed when the host reaches step N's optimizer hook, nor for a few steps after.
hookprof must then decide without the value (hold the update back on the device, keep the
step's inputs for a late replay) and never wait for it outside `flush()`. This emulation
makes hookprof's accelerator code paths run on the CPU:

- `transfer.on_host` says no tensor can be read without waiting, so output, loss and
  gradient checks stay device flags (0-d tensors) instead of host bools;
- the device copy (`_testing.device_copy_seam()`: one-value peeks, counter drains, sampled
  batches) returns a copy with an event that `query()`s ready only once the device has
  finished `lag` more optimizer steps; `synchronize()` completes it, as on a real device,
  and records which thread waited. As on one stream, waiting for a copy completes every
  copy issued before it too (a later `query()` of those says ready without waiting).

What it does not emulate: kernels really running late (values are computed at once; a test
must only look at them through hookprof), or streams.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from hookprof import _testing
from hookprof.device import transfer
from hookprof.step import dispatch


class LaggingDevice:
    def __init__(self, lag: int):
        self.lag = lag
        self.steps_done = 0  # optimizer steps the host has issued (the device is `lag` behind)
        self.waits: list[str] = []  # names of the threads that synchronized
        self.issued = 0  # copies issued so far, in stream order
        self.synced_through = 0  # every copy up to this one has completed (a wait saw it)

    def event(self) -> LaggingEvent:
        self.issued += 1
        return LaggingEvent(self, self.steps_done + self.lag, self.issued)


class LaggingEvent:
    def __init__(self, device: LaggingDevice, ready_at: int, order: int):
        self._device = device
        self._ready_at = ready_at
        self._order = order

    def query(self) -> bool:
        return (
            self._order <= self._device.synced_through or self._device.steps_done >= self._ready_at
        )

    def synchronize(self) -> None:
        self._device.waits.append(threading.current_thread().name)
        self._device.synced_through = max(self._device.synced_through, self._order)


@contextmanager
def lagging_device(lag: int) -> Iterator[LaggingDevice]:
    device = LaggingDevice(lag)
    copy_owner, copy_name = _testing.device_copy_seam()
    original_on_host, original_copy = transfer.on_host, getattr(copy_owner, copy_name)

    def start_copy(t: torch.Tensor):
        return t.detach().clone(), device.event()

    def step_done(optimizer, args, kwargs):
        device.steps_done += 1

    transfer.on_host = lambda t: False
    setattr(copy_owner, copy_name, start_copy)
    # hookprof's process-wide optimizer hooks in first (as after any earlier attach): this
    # post-hook, registered before them, would run between hookprof's pre- and post-hook,
    # where the update replay refuses another tool's (integrity/update_replay.py)
    dispatch.listen().remove()
    handle = register_optimizer_step_post_hook(step_done)
    try:
        yield device
    finally:
        handle.remove()
        transfer.on_host = original_on_host
        setattr(copy_owner, copy_name, original_copy)
