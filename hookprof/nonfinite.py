"""Every-step NaN/Inf detection that never waits for the device.

Each step's checks are folded into counters that live on the device: how many steps each
layer's gradient was non-finite, the first step it was, and the same per phase (forward:
the model's output; backward: any gradient; loss). Nothing here is read back; the counters
travel to the host with the next sampled step's batch, so the first offender is known
exactly as soon as they are drained.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import transfer
from .tensors import iter_tensors

PHASE_INDEX = {"forward": 0, "backward": 1, "loss": 2}


class DeviceCounters:
    """One device's counters. All updates are in-place device ops with Python-int operands:
    no host-to-device copy, no sync. They live in one flat tensor (the layout fold_counters
    reads), so draining them is a single block, and the per-step update is few ops."""

    def __init__(self, n_layers: int, device: torch.device):
        n, p = n_layers, len(PHASE_INDEX)
        self.flat = torch.zeros(2 * n + 2 * p, dtype=torch.int64, device=device)
        # [layer_bad | layer_first | phase_bad | phase_first], views into flat
        self.layer_bad, self.layer_first, self.phase_bad, self.phase_first = self.flat.split(
            [n, n, p, p])
        self.layer_first.fill_(-1)
        self.phase_first.fill_(-1)

    def add_layer_squares(self, squares: torch.Tensor, step: int) -> None:
        """`squares`: per-layer squared gradient norms; non-finite exactly when the layer's
        gradients hold a NaN or Inf."""
        bad = ~torch.isfinite(squares)
        self.layer_bad.add_(bad)
        self.layer_first.masked_fill_(bad & (self.layer_first < 0), step)
        self.add_phase("backward", bad.any(), step)

    def add_phase(self, phase: str, bad: torch.Tensor, step: int) -> None:
        i = PHASE_INDEX[phase]
        self.phase_bad[i].add_(bad)
        first = self.phase_first[i]
        first.masked_fill_(bad & (first < 0), step)


def nonfinite_flags(value: Any) -> list[bool | torch.Tensor]:
    """Does any floating tensor in `value` (any output structure) hold a NaN or Inf? One flag
    per device, so a step counts once however many tensors it returns: a Python bool for the
    CPU tensors (reading it waits for nothing), a 0-d bool that stays on each accelerator.
    One reduction per tensor: a sum is non-finite when any element is (it can also overflow,
    for outputs whose values add up past ~3e38, which is trouble of its own)."""
    host: bool | None = None
    on_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in iter_tensors(value):
        if not t.is_floating_point() or not t.numel():
            continue
        total = t.detach().sum()
        if transfer.on_host(total):
            host = bool(host) or not math.isfinite(float(total))
        else:
            on_device.setdefault(total.device, []).append(total)
    flags: list[bool | torch.Tensor] = [] if host is None else [host]
    for totals in on_device.values():
        flags.append(~torch.isfinite(totals[0] if len(totals) == 1 else torch.stack(totals)).all())
    return flags


def loss_flag(loss: Any) -> bool | torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        return not math.isfinite(float(loss))
    loss = loss.detach()
    if transfer.on_host(loss) and loss.numel() == 1:
        return not math.isfinite(float(loss))  # a CPU value: no device to wait for
    return ~torch.isfinite(loss).all()


class Detector:
    """The counters of every device a model's gradients live on, plus host-side counters for
    checks whose result is already on the host (CPU tensors)."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.by_device: dict[torch.device, DeviceCounters] = {}
        self.host_phase_bad = [0] * len(PHASE_INDEX)
        self.host_phase_first = [-1] * len(PHASE_INDEX)

    def counters(self, device: torch.device) -> DeviceCounters:
        c = self.by_device.get(device)
        if c is None:
            c = self.by_device[device] = DeviceCounters(self.n_layers, device)
        return c

    def add_layer_squares(self, parts: list[torch.Tensor], step: int) -> None:
        for squares in parts:
            self.counters(squares.device).add_layer_squares(squares, step)

    def add_flag(self, phase: str, flag: bool | torch.Tensor, step: int) -> None:
        if isinstance(flag, torch.Tensor):
            self.counters(flag.device).add_phase(phase, flag, step)
        elif flag:
            i = PHASE_INDEX[phase]
            self.host_phase_bad[i] += 1
            if self.host_phase_first[i] < 0:
                self.host_phase_first[i] = step

    def blocks(self) -> list[torch.Tensor]:
        """Everything to drain, one flat int64 block per device and, once a host-side check
        has found something, one for the host counters; in the layout fold_counters reads."""
        out = [c.flat for c in self.by_device.values()]
        if self.host_total():  # nothing to say while no host-side check has found anything
            n = self.n_layers
            host = [0] * n + [-1] * n + self.host_phase_bad + self.host_phase_first
            out.append(torch.tensor(host, dtype=torch.int64))
        return out

    def host_total(self) -> int:
        return sum(self.host_phase_bad)


def fold_counters(parts: list[list[float]], n_layers: int) -> dict[str, list[int]]:
    """Host side: combine the drained counters of all devices. Each part is the flat
    [layer_bad, layer_first, phase_bad, phase_first] of one device."""
    n_phases = len(PHASE_INDEX)
    layer_bad = [0] * n_layers
    layer_first = [-1] * n_layers
    phase_bad = [0] * n_phases
    phase_first = [-1] * n_phases

    def first_of(a: int, b: int) -> int:
        return b if a < 0 else a if b < 0 else min(a, b)

    for flat in parts:
        values = [int(v) for v in flat]
        lb = values[:n_layers]
        lf = values[n_layers : 2 * n_layers]
        pb = values[2 * n_layers : 2 * n_layers + n_phases]
        pf = values[2 * n_layers + n_phases :]
        for i in range(n_layers):
            layer_bad[i] += lb[i]
            layer_first[i] = first_of(layer_first[i], lf[i])
        for i in range(n_phases):
            # a step bad on two devices is one bad step: the larger count is the better bound
            phase_bad[i] = max(phase_bad[i], pb[i])
            phase_first[i] = first_of(phase_first[i], pf[i])
    return {
        "layer_bad": layer_bad,
        "layer_first": layer_first,
        "phase_bad": phase_bad,
        "phase_first": phase_first,
    }
