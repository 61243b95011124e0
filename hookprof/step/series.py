"""Every step's loss and global gradient norm, kept on the device until a drain takes them.

The report and `top` show the run up to an incident step by step (issue 41), not only its
sampled steps. Reading each step's two values back would be a copy per step; instead each
step writes them into its slot of a small ring on the device (`RING` rows of [loss, norm],
float64, per device: a float32 norm overflows past ~1.8e19, where divergences go), and the
ring rides the next drain's one copy (pack_step): a sampled step's packet, the counters'
drain after a NaN, `flush()`, `detach()`, or a drain forced every `DRAIN_EVERY` steps, so
that no slot is written over before a drain has read it.

The cost per step, on the device path: the loss `copy_` into its slot, and the gradient
norm written with `out=` into its slot by the norm of the gradients the step's check already
reads (GradientNorms.layer_checks): two ATen ops, nothing read back.

The host keeps what each slot holds (`_meta`: the step, where its loss is, which devices
wrote a norm) as immutable tuples, replaced when a value comes, so that a drain's snapshot
of them agrees with the ring copied at the same moment. A loss that is a Python number (or
a tensor on the host) is kept in the tuple itself.

Owned by the profiler; written on the training thread (the norm also on autograd's thread
while the training thread waits in backward()). The publisher reads the drained values
(`decode`) on its own thread.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from hookprof.device import transfer

RING = 512  # steps kept on the device between drains
DRAIN_EVERY = RING // 2  # a drain at least this often: a late loss is still in its slot

_LOSS, _NORM = 0, 1  # the ring's columns
# a norm written as "no value" on the device (a NaN there is a NaN gradient's norm): a step
# a fused optimizer's GradScaler skipped for an overflow
NO_NORM = -1.0


class _Ring(NamedTuple):
    values: torch.Tensor  # [RING, 2] float64
    loss: list[torch.Tensor]  # 0-d views of the loss column, one per slot (made once)
    norm: list[torch.Tensor]


class SlotMeta(NamedTuple):
    """What a slot holds: `step`'s values; `loss` is None (none given), a float (a loss read
    on the host) or the device whose ring holds it; `norm` the devices that wrote a norm;
    `seconds` the step's time, measured on the host (StepCounters), once it ended."""

    step: int
    loss: float | torch.device | None
    norm: tuple[torch.device, ...]
    seconds: float | None = None


class StepValue(NamedTuple):
    """One step's values as the publisher gets them (None: not given, not read)."""

    step: int
    loss: float | None
    grad_norm: float | None
    step_seconds: float | None = None


class SeriesDrain(NamedTuple):
    """What a packet carries of the series: the devices in the order of the batch's
    ("series", k) blocks, each the rows of steps `first`, `first` + 1, ... of its ring; the
    meta of those steps' slots as the blocks were copied."""

    devices: tuple[torch.device, ...]
    meta: tuple[SlotMeta, ...]
    first: int


class StepSeries:
    """The device rings and the host's meta of their slots (see the module's docstring)."""

    __slots__ = ("_rings", "_meta", "_slot", "due", "_taken")

    def __init__(self) -> None:
        self._rings: dict[torch.device, _Ring] = {}
        self._meta: list[SlotMeta | None] = [None] * RING
        self._slot = 0
        self.due = DRAIN_EVERY  # the step at whose end a drain is due (profiler: forced)
        self._taken = 1  # the first step the next drain holds

    def _ring(self, device: torch.device) -> _Ring:
        ring = self._rings.get(device)
        if ring is None:
            values = torch.full((RING, 2), math.nan, dtype=torch.float64, device=device)
            ring = self._rings[device] = _Ring(
                values, list(values[:, _LOSS].unbind()), list(values[:, _NORM].unbind())
            )
        return ring

    def begin(self, step: int, previous_seconds: float | None = None) -> None:
        """Step `step` begins (and the one before it took `previous_seconds`, on the host):
        its slot is cleared (on the host: the ring keeps old values, which the meta no longer
        points at). A drain made as the previous step ended holds it without its time: the
        next drain holds it again (`take`)."""
        before = self._meta[self._slot]
        if previous_seconds is not None and before is not None and before.step == step - 1:
            self._meta[self._slot] = SlotMeta(
                before.step, before.loss, before.norm, previous_seconds
            )
        self._slot = step % RING
        self._meta[self._slot] = SlotMeta(step, None, ())

    def loss(self, loss: Any, step: int | None = None) -> torch.Tensor | None:
        """The loss of the current step (or of `step`, a late one, while its slot is still
        its own): a one-element real tensor or a number (profiler.step has checked it).
        Returns its slot when the copy went there (a loss on a device: the non-finite check
        reads it there, a float64 with no grad, one `detach` less per step), else None."""
        slot = self._slot if step is None else step % RING
        meta = self._meta[slot]
        if meta is None or (step is not None and meta.step != step):
            return None  # written over already: a late loss of a step RING steps back
        # (SlotMeta(...) whole, not _replace: one Python frame per step, not four)
        if not isinstance(loss, torch.Tensor):
            self._meta[slot] = SlotMeta(meta.step, float(loss), meta.norm, meta.seconds)
            return None
        if transfer.on_host(loss):
            # readable without waiting (a CPU model's): kept on the host, as Packet.loss is
            self._meta[slot] = SlotMeta(meta.step, loss.item(), meta.norm, meta.seconds)
            return None
        ring = self._rings.get(loss.device) or self._ring(loss.device)  # (no call: made once)
        view = ring.loss[slot]
        with torch.no_grad():  # the ring never joins the graph
            view.copy_(loss if loss.dim() == 0 else loss.reshape(()))
        self._meta[slot] = SlotMeta(meta.step, loss.device, meta.norm, meta.seconds)
        return view

    def current_values(self) -> tuple[float | torch.Tensor | None, list[torch.Tensor]]:
        """The current step's loss (a number read on the host, its 0-d slot on a device, or
        None: not given) and its gradient norms (0-d slots, one per device that wrote one),
        as the spike replay's gate reads them (integrity/spike_replay.py)."""
        meta = self._meta[self._slot]
        if meta is None:
            return None, []
        norms = [self._rings[d].norm[self._slot] for d in meta.norm]
        if isinstance(meta.loss, torch.device):
            return self._rings[meta.loss].loss[self._slot], norms
        return meta.loss, norms

    def norm_slot(self, device: torch.device) -> torch.Tensor:
        """The 0-d view the current step's gradient norm on `device` is written into."""
        meta = self._meta[self._slot]
        if meta is not None and device not in meta.norm:
            self._meta[self._slot] = SlotMeta(
                meta.step, meta.loss, (*meta.norm, device), meta.seconds
            )
        return (self._rings.get(device) or self._ring(device)).norm[self._slot]

    def write_norm_of_squares(self, parts: list[torch.Tensor]) -> None:
        """The norm from per-layer squared norms, one tensor per device (a sampled step's
        exact squares, or the general path's): sqrt of their sum, into the slot."""
        for part in parts:
            torch.sqrt(part.sum(), out=self.norm_slot(part.device))

    def unscale_norm(self, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """A fused optimizer's GradScaler step: the gradients read still carried its scale
        (divided out), and on a step it skips for an overflow (`found_inf`) the norm is no
        value (NO_NORM), as a skipped step's is without a fused optimizer: an overflow the
        scaler handles is no divergence. Once per reading (StepGradients.unscale)."""
        meta = self._meta[self._slot]
        for device in meta.norm if meta is not None else ():
            slot = self._rings[device].norm[self._slot]
            if scale is not None:
                slot.div_(scale.to(device).reshape(()))
            if found_inf is not None:
                slot.masked_fill_(found_inf.to(device).reshape(()) > 0, NO_NORM)

    def take(self, step: int) -> tuple[list[list[torch.Tensor]], SeriesDrain]:
        """For a drain after step `step` ended: the rings (to copy) and the meta of the steps
        since the last drain's last one (again: its loss may have come late, after the
        optimizer ended it), so that the publisher's work is per new step, not per slot."""
        first, self._taken = min(max(self._taken, step - RING + 1), step), step
        self.due = step + DRAIN_EVERY
        meta = self._meta
        held = tuple(
            m for s in range(first, step + 1) if (m := meta[s % RING]) is not None and m.step == s
        )
        devices = tuple(self._rings)
        a, b = first % RING, step % RING + 1  # only those rows are copied: views, one or two
        rows = [
            [v[a:b]] if a < b else [v[a:], v[:b]] for v in (self._rings[d].values for d in devices)
        ]
        return rows, SeriesDrain(devices, held, first)


def norm_into(slot: torch.Tensor, sources: list[torch.Tensor]) -> None:
    """Write the L2 norm over all of several `sources` into the 0-d float64 `slot`,
    accumulated in float64 (a float32 sum of squares overflows at a norm of ~1.8e19): each
    one's norm, stacked, normed. (One source, the usual case, is one op that
    GradientNorms.layer_checks writes inline: a Python call less per step.)"""
    norms = [torch.linalg.vector_norm(s, dtype=torch.float64) for s in sources]
    torch.linalg.vector_norm(torch.stack(norms), out=slot)


def decode(drain: SeriesDrain, blocks: list[list[float]], up_to: int) -> list[StepValue]:
    """The steps a drain holds, in order (take() gathers them so), up to step `up_to` (the
    last that ended when it was packed: the current step's slot may hold half its values)."""
    out = []
    where = {d: k for k, d in enumerate(drain.devices)}
    for meta in drain.meta:
        if meta.step > up_to:
            continue
        row = meta.step - drain.first  # in the blocks
        loss = meta.loss
        if isinstance(loss, torch.device):
            k = where.get(loss)
            loss = blocks[k][2 * row + _LOSS] if k is not None else None
        grad_norm = None
        if meta.norm:
            norms = [blocks[where[d]][2 * row + _NORM] for d in set(meta.norm) if d in where]
            if norms and NO_NORM not in norms:
                grad_norm = math.sqrt(sum(n * n for n in norms))
        out.append(StepValue(meta.step, loss, grad_norm, meta.seconds))
    return out
