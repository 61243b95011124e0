"""Every-step NaN/Inf detection that never waits for the device.

Each step's checks are folded into counters that live on the device: how many steps each
layer's gradient was non-finite, the first step it was, and the same per phase (forward:
the model's output; backward: any gradient; loss). Nothing here is read back; the counters
travel to the host with the next sampled step's batch, so the first offender is known
exactly as soon as they are drained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hookprof.device import transfer
from hookprof.tensors import iter_tensors

PHASE_INDEX = {"forward": 0, "backward": 1, "loss": 2}


# phases as stored on the device: "backward" first, after the layers and the dropped slot,
# so that the ops of the gradients' check write them together (the layout fold_counters reads)
_STORED_PHASES = ("backward", "forward", "loss")

# the groups of a device's pending slots that one check writes whole (DeviceCounters)
_LAYERS, _FORWARD, _LOSS, _DROPPED = "layers", "forward", "loss", "dropped"


# the dtype a check's sum is taken in, where the tensor's own would overflow before the values do
_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def nonfinite_mask(t: torch.Tensor) -> torch.Tensor:
    """True where `t` (floating) holds a NaN or Inf: x - x is exactly 0 for every finite x and
    NaN for NaN and +-Inf. Two ops where `~torch.isfinite(t)` is five (isfinite is abs, ne,
    eq, mul), each a kernel launch on a GPU, on every step."""
    return t.sub(t).ne(0)


class DeviceCounters:
    """One device's counters. All updates are in-place device ops with Python-int operands:
    no host-to-device copy, no sync. They live in one flat tensor (the layout fold_counters
    reads), so draining them is a single block. A step's findings are first written into a
    `pending` vector of the same layout (each written in place by the op that checks it: no
    clearing per step) and folded into the counters once, at the step's end (`end_step`:
    three ops), whatever the model's size and however many checks the step made.

    Beside the phases, one slot counts the steps whose backward made non-finite gradients
    that the loop dropped before any update (a loss scaler's overflow, a guard: no incident,
    issue 38), and `dropped_values` keeps the backward's per-layer values of the first such
    step, which name its layers.

    The layout, per half: [layers | dropped | backward, forward, loss]. The dropped slot sits
    just before the backward phase so that, where the gradients were read twice, one `any`
    over the two readings' masks writes both readings' flags at once (the backward's into
    the dropped slot, compared there; the update's into the backward phase's: issue 37)."""

    def __init__(self, n_layers: int, device: torch.device):
        n, p = n_layers, len(_STORED_PHASES)
        m = n + 1 + p  # layers | dropped | phases
        self.flat = torch.zeros(2 * m, dtype=torch.int64, device=device)
        # [layer_bad | dropped_bad | phase_bad | layer_first | dropped_first | phase_first],
        # phases in _STORED_PHASES order
        bad, first = self.flat.split([m, m])
        first.fill_(-1)
        self.layer_bad, self.dropped_bad, self.phase_bad = bad.split([n, 1, p])
        self.layer_first, self.dropped_first, self.phase_first = first.split([n, 1, p])
        # views made once: indexing per step would be one more op each time
        self._phase = {
            name: (bad[n + 1 + k], first[n + 1 + k]) for k, name in enumerate(_STORED_PHASES)
        }
        self._bad, self._first = bad, first
        # this step's findings, [layers | dropped | phases] as in `bad`, until `end_step`.
        # Each group of slots is *assigned* by the op that checks it (an `out=`, a copy), not
        # or-ed into a cleared vector: no clearing op per step. A group that held a finding
        # of an earlier step and was not written in this one (a step without a loss, without
        # gradients) is cleared before the fold, once (`_dirty`)
        self.pending = torch.zeros(m, dtype=torch.bool, device=device)
        self._pending_layers = self.pending[:n]
        self._pending_dropped = self.pending[n : n + 1]
        self._pending_backward = self.pending[n + 1 : n + 2]
        # the two readings' flags, [backward's, update's]: the dropped slot and the backward
        # phase's, side by side (end_step)
        self._two_readings = self.pending[n : n + 2]
        # 0-d views: a 0-d flag or check is written into them without a reshape
        # (public: a step's first output check writes itself there, Detector.forward_slots)
        self.forward_slot = self.pending[n + 1 + _STORED_PHASES.index("forward")]
        self._pending_loss = self.pending[n + 1 + _STORED_PHASES.index("loss")]
        self._groups = {
            # the layers, the dropped slot and the backward phase: all written together by
            # two readings, all but the dropped slot by one (then _DROPPED is stale, cleared)
            _LAYERS: self.pending[: n + 2],
            _FORWARD: self.forward_slot,
            _LOSS: self._pending_loss,
            _DROPPED: self._pending_dropped,
        }
        self._written: set[str] = set()  # the groups this step wrote (host-side: no op)
        self._dirty: set[str] = set()  # the groups that may hold an earlier step's finding
        # where a slot goes bad for the first time this step (written in place each step)
        self._fresh = torch.zeros(m, dtype=torch.bool, device=device)
        self._fresh_dropped = self._fresh[n]
        # the two readings' per-layer masks, [2, n], and its rows (views made once)
        self._masks = torch.zeros(2, n, dtype=torch.bool, device=device)
        self._backward_mask, self._update_mask = self._masks[0], self._masks[1]
        # float64, whatever the readings' dtype: `where` promotes into it (no op more), a
        # float64 square is never cast down to an inf, and the counters it travels with in
        # one batch (ScalarBatch: cat) stay int64-exact past 2^24 (float32 promoted them: review)
        self.dropped_values = torch.zeros(n, dtype=torch.float64, device=device)

    def note_loss(self, loss: torch.Tensor) -> None:
        """This step's loss (a tensor on this device that needs no grad: its slot in the
        step series' ring, or a detached loss), checked into its slot: two ops for the usual
        0-d loss (x - x, then != 0 written in place), none to fold it later."""
        if loss.requires_grad:  # (an attribute read, no op)
            loss = loss.detach()
        diff = loss.sub(loss)  # nonfinite_mask, written in place
        if _LOSS in self._written:  # a second loss of the step (prof.step() twice): or-ed
            self._pending_loss.logical_or_(diff.ne(0).any())
        elif diff.dim() == 0:
            torch.ne(diff, 0, out=self._pending_loss)
        else:
            torch.any(diff.ne(0), out=self._pending_loss)
        self._written.add(_LOSS)

    def end_step(
        self,
        values: torch.Tensor | None,
        forward: torch.Tensor | None,
        step: int,
        backward: torch.Tensor | None = None,
    ) -> None:
        """Step `step` ends with its per-layer values where the update read the gradients
        (squared norms, or gradient sums: non-finite exactly when the layer's gradients hold
        a NaN or Inf), its output flag on this device and, where the gradients were also read
        as the backward ended, that reading's values (`backward`; any may be None): with what
        it noted before (the loss), counted, and the first step of each layer and phase that
        went bad set where it was not yet.

        Two readings are joined here: the layers counted are the backward's where both
        readings are non-finite (a NaN the backward made, then spread to every layer by a
        clip), else the update's (a NaN made after backward() keeps its own layers); the
        backward phase is bad exactly when the update's reading is; a step whose backward
        was non-finite and whose update was not was dropped by the loop (no incident, but
        counted and its layers kept). Seven ops: the masks of both, stacked, in three; both
        flags in one `any`; the layers by a `where`; the dropped slot by a compare in place."""
        written = self._written
        if values is not None and backward is not None:
            both = torch.stack((backward, values))  # (float64 if either is: stack promotes)
            torch.ne(both.sub(both), 0, out=self._masks)  # x - x: nonfinite_mask
            flags = torch.any(self._masks, 1, out=self._two_readings)  # [backward's, update's]
            torch.where(
                flags.all(), self._backward_mask, self._update_mask, out=self._pending_layers
            )
            # dropped: the backward's bad where the update's is not (in its own slot)
            torch.gt(self._pending_dropped, self._pending_backward, out=self._pending_dropped)
            written.add(_LAYERS)
            written.add(_DROPPED)
        elif values is not None:
            torch.ne(values.sub(values), 0, out=self._pending_layers)  # x - x: nonfinite_mask
            torch.any(self._pending_layers, 0, keepdim=True, out=self._pending_backward)
            written.add(_LAYERS)
        if forward is not None:
            if forward is not self.forward_slot:  # (the first check wrote itself there)
                self.forward_slot.copy_(forward if forward.dim() == 0 else forward.reshape(()))
            written.add(_FORWARD)
        stale = self._dirty - written
        for group in stale:  # (none on a step that checks what the last one did)
            self._groups[group].zero_()
        self._dirty, self._written = written, set()
        if written:
            pending = self.pending
            # first = step where pending and no earlier bad step: -1 + (step + 1); two ops
            # (pending > bad: pending and bad == 0), where lt/and/masked_fill were three
            fresh = torch.gt(pending, self._bad, out=self._fresh)
            self._first.add_(fresh, alpha=step + 1)
            self._bad.add_(pending)
            if backward is not None and values is not None:  # the first dropped step's layers
                torch.where(
                    self._fresh_dropped,
                    backward,
                    self.dropped_values,
                    out=self.dropped_values,
                )

    def add_phase(self, phase: str, bad: torch.Tensor, step: int) -> None:
        count, first = self._phase[phase]
        count.add_(bad)
        first.masked_fill_(bad & first.lt(0), step)


def nonfinite_flags(
    value: Any, slots: dict[torch.device, torch.Tensor] | None = None
) -> list[bool | torch.Tensor]:
    """Does any floating tensor in `value` (any output structure) hold a NaN or Inf? One flag
    per device, so a step counts once however many tensors it returns: a Python bool for the
    CPU tensors (reading it waits for nothing), a 0-d bool that stays on each accelerator.
    One reduction per tensor: a sum is non-finite when any element is. It is taken in float32
    at least: a float16 sum past 65504 is an overflow of the check, not of the output (a
    finite fp16 output read as non-finite, issue 38); a float32 output can read as
    non-finite only when its values add up past ~3.4e38, values about to overflow. With
    `slots` (Detector.forward_slots), the usual output's device flag is written into its
    device's slot, where there is one, and that tensor returned."""
    if type(value) is torch.Tensor:  # the usual output: one tensor (no walk, no stack)
        if value.is_complex():  # its real view: the same NaN/Inf (issue 39)
            value = torch.view_as_real(value)
        if not value.is_floating_point() or not value.numel():
            return []
        total = value.detach().sum(dtype=_SUM_DTYPE.get(value.dtype))
        if transfer.on_host(total):
            return [not math.isfinite(float(total))]
        into = None if slots is None else slots.get(total.device)
        if into is not None:
            torch.ne(total.sub(total), 0, out=into)  # nonfinite_mask, inline, in its slot
            return [into]
        return [total.sub(total).ne(0)]  # nonfinite_mask, inline; a 0-d needs no any()
    host: bool | None = None
    on_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in iter_tensors(value):
        if t.is_complex():
            t = torch.view_as_real(t)
        if not t.is_floating_point() or not t.numel():
            continue
        total = t.detach().sum(dtype=_SUM_DTYPE.get(t.dtype))
        if transfer.on_host(total):
            host = bool(host) or not math.isfinite(float(total))
        else:
            on_device.setdefault(total.device, []).append(total)
    flags: list[bool | torch.Tensor] = [] if host is None else [host]
    for totals in on_device.values():
        flags.append(nonfinite_mask(totals[0] if len(totals) == 1 else torch.stack(totals)).any())
    return flags


def loss_flag(loss: Any) -> bool | torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        return not math.isfinite(float(loss))
    loss = loss.detach()
    if transfer.on_host(loss) and loss.numel() == 1:
        return not math.isfinite(float(loss))  # a CPU value: no device to wait for
    bad = loss.sub(loss).ne(0)  # nonfinite_mask, inline: once per step
    return bad if bad.dim() == 0 else bad.any()


class Detector:
    """The counters of every device a model's gradients live on, plus host-side counters for
    checks whose result is already on the host (CPU tensors)."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.by_device: dict[torch.device, DeviceCounters] = {}
        # per device, the 0-d bool a step's first output check writes itself into (`out=`):
        # the step's end then has no copy to make (issue 37; nonfinite_flags)
        self.forward_slots: dict[torch.device, torch.Tensor] = {}
        self.host_phase_bad = [0] * len(PHASE_INDEX)
        self.host_phase_first = [-1] * len(PHASE_INDEX)

    def counters(self, device: torch.device) -> DeviceCounters:
        c = self.by_device.get(device)
        if c is None:
            c = self.by_device[device] = DeviceCounters(self.n_layers, device)
            self.forward_slots[device] = c.forward_slot
        return c

    def note_loss(self, loss: Any, step: int) -> None:
        """The loss of this step (`step`): on a device, checked there and counted at the
        step's end (`end_step`); a value on the host, counted at once."""
        if isinstance(loss, torch.Tensor) and not (transfer.on_host(loss) and loss.numel() == 1):
            counters = self.by_device.get(loss.device) or self.counters(loss.device)
            counters.note_loss(loss)
        else:  # a number or a one-element CPU tensor (loss_flag's host case, inline: every step)
            value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
            self.add_flag("loss", not math.isfinite(value), step)

    def end_step(
        self,
        layer_parts: list[torch.Tensor],
        forward_flags: list[bool | torch.Tensor],
        step: int,
        backward: dict[torch.device, torch.Tensor] | None = None,
    ) -> None:
        """Step `step` ends: its per-layer values where the update read the gradients (one
        part per device), its output flags (the step's, combined: OutputFlags.step_flags, at
        most one per device and one host bool), the backward's reading of the gradients per
        device where they were read twice (`backward`) and what it noted before (the loss)
        are counted, one call per device."""
        values: dict[torch.device, torch.Tensor] = {}
        forward: dict[torch.device, torch.Tensor] = {}
        for part in layer_parts:  # (loops, not comprehensions: no Python call each step)
            values[part.device] = part
        for flag in forward_flags:
            if isinstance(flag, torch.Tensor):
                forward[flag.device] = flag
            elif flag:
                self.add_flag("forward", True, step)
        for device in (*values, *forward):
            if device not in self.by_device:
                self.counters(device)
        for device, counters in self.by_device.items():
            counters.end_step(
                values.get(device),
                forward.get(device),
                step,
                None if backward is None else backward.get(device),
            )

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
            stored = [PHASE_INDEX[p] for p in _STORED_PHASES]
            host = (
                [0] * n
                + [0]
                + [self.host_phase_bad[i] for i in stored]
                + [-1] * n
                + [-1]
                + [self.host_phase_first[i] for i in stored]
            )
            out.append(torch.tensor(host, dtype=torch.int64))
        return out

    def dropped_blocks(self) -> list[torch.Tensor]:
        """Per device, the backward's per-layer values of the first step whose non-finite
        gradients the loop dropped (zeros until there is one), in `blocks`' device order."""
        return [c.dropped_values for c in self.by_device.values()]

    def host_total(self) -> int:
        return sum(self.host_phase_bad)


def fold_counters(
    parts: list[list[float]], n_layers: int, dropped_values: Sequence[list[float]] = ()
) -> dict[str, list[int]]:
    """Host side: combine the drained counters of all devices. Each part is the flat
    [layer_bad, dropped_bad, phase_bad, layer_first, dropped_first, phase_first] of one
    device (phases stored in _STORED_PHASES order; returned in PHASE_INDEX order);
    `dropped_values`, the devices' kept backward values of their first dropped step, in
    the same device order (the host's block, last, has none), give "dropped_layers": 1 for
    each layer non-finite at the first dropped step of all devices."""
    n_phases = len(PHASE_INDEX)
    layer_bad = [0] * n_layers
    layer_first = [-1] * n_layers
    phase_bad = [0] * n_phases
    phase_first = [-1] * n_phases
    dropped_bad, dropped_first = 0, -1
    dropped_layers = [0] * n_layers

    half = n_layers + 1 + n_phases
    for k, flat in enumerate(parts):
        values = [int(v) for v in flat]
        lb, lf = values[:n_layers], values[half : half + n_layers]
        pb = [0] * n_phases
        pf = [0] * n_phases
        for j, name in enumerate(_STORED_PHASES):
            pb[PHASE_INDEX[name]] = values[n_layers + 1 + j]
            pf[PHASE_INDEX[name]] = values[half + n_layers + 1 + j]
        for i in range(n_layers):
            layer_bad[i] += lb[i]
            layer_first[i] = first_step(layer_first[i], lf[i])
        for i in range(n_phases):
            # a step bad on two devices is one bad step: the larger count is the better bound
            phase_bad[i] = max(phase_bad[i], pb[i])
            phase_first[i] = first_step(phase_first[i], pf[i])
        dropped_bad = max(dropped_bad, values[n_layers])
        device_first = values[half + n_layers]
        if (
            device_first >= 0
            and k < len(dropped_values)
            and first_step(dropped_first, device_first) == device_first
        ):
            layers = [int(not math.isfinite(v)) for v in dropped_values[k]]
            # the earlier device's layers; a step dropped on two devices, both's
            dropped_layers = (
                [a | b for a, b in zip(dropped_layers, layers)]
                if device_first == dropped_first
                else layers
            )
        dropped_first = first_step(dropped_first, device_first)
    return {
        "layer_bad": layer_bad,
        "layer_first": layer_first,
        "phase_bad": phase_bad,
        "phase_first": phase_first,
        "dropped_bad": [dropped_bad],
        "dropped_first": [dropped_first],
        "dropped_layers": dropped_layers,
    }


def first_step(a: int, b: int) -> int:
    """The earlier of two first steps (-1: none yet)."""
    return b if a < 0 else a if b < 0 else min(a, b)


def merge_counters(
    old: dict[str, list[int]] | None, new: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Two drains of the same cumulative counters (fold_counters), folded in either order: the
    larger counts and the earlier first steps, so a drain folded late takes nothing back."""
    if old is None:
        return new
    return {
        key: [
            first_step(a, b) if key.endswith("_first") else max(a, b)
            for a, b in zip(old[key], new[key])
        ]
        for key in new
    }
