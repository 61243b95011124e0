"""How efficiently a model trains, from its sampled steps: FLOPs per layer and achieved
FLOP/s, the model's FLOP/s and utilisation of the device's peak, weight and update norms.

Two halves, one per thread, joined by the step's Packet:
- `StepEfficiency` (training thread) notes layer calls, takes the parameter copies before
  the update (updates.py: the measurement, whose turn and interval it keeps) and, at a
  sampled step's end, counts new FLOPs signatures (flops.py) and hands the measured update
  to the statistics of source "update" (step/update_statistics.py: the built-in weight
  norm, update norm and update ratio are such statistics), whose sums ride the step's one
  device-to-host copy;
- `EfficiencyTotals` (publisher thread) folds the packet with the step's per-layer times,
  and the update ratio statistic's (update², weight²) per layer that the aggregator hands it,
  into an `EfficiencyStats` for the snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from hookprof.efficiency import peaks
from hookprof.efficiency.flops import FlopCounter
from hookprof.efficiency.updates import UpdateNorms
from hookprof.layers import LayerTable
from hookprof.snapshot import EfficiencyStats, LayerEfficiency

_UNREAD = object()


@dataclass(slots=True)
class EfficiencyPart:
    """A sampled step's efficiency figures known on the host."""

    flops: tuple[list[int], list[int], list[int], int] | None = None  # FlopCounter.end_step()
    seconds_per_step: float | None = None  # wall time per step since the last sampled step
    peak_flops: float | None = None


class StepEfficiency:
    """The training-thread half. Every method is cheap on unsampled steps (not called)."""

    @classmethod
    def from_config(
        cls, table: LayerTable, config: Any, notices: Any, model_name: str
    ) -> StepEfficiency:
        """The figures with their slice of the config (flop_counting, update_norms,
        update_norm_max_bytes, peak_flops, update_norm_interval_s)."""
        return cls(
            table,
            flops=config.flop_counting,
            update_norms=config.update_norms,
            update_max_bytes=config.update_norm_max_bytes,
            peak_flops=config.peak_flops,
            notices=notices,
            model_name=model_name,
            update_interval_s=config.update_norm_interval_s,
        )

    def __init__(
        self,
        table: LayerTable,
        *,
        flops: bool,
        update_norms: bool,
        update_max_bytes: int,
        peak_flops: float | None,
        notices: Any,
        model_name: str = "the model",
        update_interval_s: float = 0.0,
    ):
        self._table = table
        self._notices = notices
        self.flops = FlopCounter(table, notices) if flops else None
        self.updates = UpdateNorms(table, update_max_bytes) if update_norms else None
        self._peak_set = peak_flops
        self._model_name = model_name
        self._device = next(iter(table.params)).device
        self._dtype = next((p.dtype for p in table.params if p.is_floating_point()), torch.float32)
        self._precision: str | None = None  # seen during the sampled step's forward
        self._last_end: tuple[int, int] | None = None  # (step, ns) of the last sampled step's end
        self._hooks: Any = None  # the LayerHooks reporting layer calls (listen)
        self._device_name: Any = _UNREAD  # peaks.device_name, read at the first _peak
        self._peaks: dict[str | None, float | None] = {}  # precision -> the device's peak
        self._update_interval_ns = int(update_interval_s * 1e9)
        self._last_update_ns: int | None = None  # when update norms were last measured

    @property
    def enabled(self) -> bool:
        return self.flops is not None or self.updates is not None

    def listen(self, hooks: Any) -> None:
        """Have `hooks` (instrument.LayerHooks) report the training layer calls of sampled
        steps: each step's first call here, the others straight to the FLOP counter."""
        self._hooks = hooks
        hooks.listen(self.first_call)

    def first_call(self, layer: int, args: tuple, kwargs: dict | None, nested: bool) -> None:
        """The first layer call of a sampled step's training forward. The precision is read
        here: autocast is on only during the forward, and may be switched on inside the
        model's own forward, so the root's forward pre-hook could miss it. The step's other
        calls go straight to FlopCounter.note (it never raises): one Python frame less each."""
        try:
            self._precision = peaks.precision_of(self._dtype, self._device.type)
        except Exception as exc:  # never into the training loop, nor switching the hooks off
            self._notices.say(
                "flops precision",
                f"the precision of {self._model_name} cannot be "
                f"read ({exc!r}): model FLOPs utilisation may be missing",
            )
        flops = self.flops
        assert flops is not None  # (this listener is registered only with a FLOP counter)
        self._hooks.listen(flops.note)
        flops.note(layer, args, kwargs, nested)

    def _rearm(self) -> None:
        """The step is over: the next one's first layer call reads the precision again."""
        if self._hooks is not None:
            self._hooks.listen(self.first_call)

    def before_update(self, now_ns: int, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A sampled step's update (by `optimizer`) is about to happen: copy what its turn
        needs, at most once per update_interval_s."""
        if self.updates is None or self.updates.taken:
            return
        if (
            self._last_update_ns is not None
            and now_ns - self._last_update_ns < self._update_interval_ns
        ):
            return
        self._last_update_ns = now_ns
        if optimizer is not None:
            self.updates.follow(optimizer)
        self.updates.before_update()

    def end_step(self, step: int, now_ns: int, duration_s: float) -> EfficiencyPart:
        """A sampled step ended (its update done): its host figures."""
        part = EfficiencyPart()
        if self._last_end is not None and step > self._last_end[0]:
            part.seconds_per_step = (now_ns - self._last_end[1]) * 1e-9 / (step - self._last_end[0])
        else:
            part.seconds_per_step = duration_s
        self._last_end = (step, now_ns)
        if self.flops is not None:
            part.flops = self.flops.end_step()
            # the peak matters (and its absence is worth saying) only once there are FLOPs:
            # a compiled model has no per-layer calls to count
            part.peak_flops = self._peak() if part.flops[3] else None
        self._rearm()
        return part

    def measured_update(self) -> UpdateNorms | None:
        """The update measurement holding this step's copies, for the statistics of source
        "update" to read (and free): None when this step's update was not measured."""
        updates = self.updates
        return updates if updates is not None and updates.taken else None

    def drop(self) -> None:
        self._rearm()
        if self.flops is not None:
            self.flops.drop()
        if self.updates is not None:
            self.updates.drop()

    def _peak(self) -> float | None:
        """The device's peak FLOP/s in the step's precision: looked up (regexes over the
        device's name, peaks.py) once per precision, the name read once: a process's device
        keeps its name."""
        if self._peak_set is not None:
            return self._peak_set
        precision = self._precision
        if precision in self._peaks:
            return self._peaks[precision]
        if self._device_name is _UNREAD:
            self._device_name = peaks.device_name(self._device)
        name = self._device_name
        peak = peaks.lookup(name, precision) if name and precision else None
        if peak is None:
            where = (
                f"{name} in {precision or self._dtype}"
                if name
                else f"{self._device.type} (no default peak off CUDA)"
            )
            self._notices.say(
                "peak flops",
                (
                    f"the peak FLOP/s of {where} is unknown, so model FLOPs utilisation "
                    f"(hookprof_model_flops_utilization_ratio) is not exported for {self._model_name}; "
                    "set Config.peak_flops (HOOKPROF_PEAK_FLOPS) to the device's peak for the "
                    "precision the model computes in"
                ),
            )
        self._peaks[precision] = peak
        return peak


class EfficiencyTotals:
    """The publisher-thread half: the last sampled step's figures, and each layer's latest
    update measurement (layers take turns, see updates.py) as the update ratio statistic's
    values (update², weight²), with the weight and update norm statistics' rows for the
    snapshot's LayerEfficiency (the aggregator folds all three: note_updates)."""

    def __init__(self, names: list[str]):
        self._names = names
        n = len(names)
        self._layer_flops: list[tuple[float | None, float | None, float | None]] = [
            (None, None, None)
        ] * n
        # (update², weight²) of each layer's last measured update
        self._update: list[tuple[float, float] | None] = [None] * n
        # the weight norm, update norm and update ratio statistics' rows (LayerEfficiency)
        none: list[float | None] = [None] * n
        self._norms: tuple[list[float | None], ...] = (none, none, none)
        self._model: tuple[float | None, float | None, float | None] = (None, None, None)
        self._stats: EfficiencyStats | None = None
        # the update-to-weight ratios of the layers the last folded step measured (its turn
        # of layers: updates.py), for the update ratio jumps (publish/spikes.py)
        self.step_ratios: dict[str, float] = {}

    def fold(self, packet: Any, fwd_seconds: list[float], bwd_seconds: list[float]) -> None:
        part: EfficiencyPart = packet.efficiency
        n = len(self._names)
        if part.flops is not None:
            fwd, bwd, calls, model = part.flops
            for i in range(n):
                if not calls[i]:
                    continue  # not called, or not counted yet: the last figures stay
                # a backward that was not timed (a layer whose backward hookprof could not
                # see) is left out of the rate rather than done in no time
                with_bwd = bwd_seconds[i] > 0
                timed = fwd_seconds[i] + (bwd_seconds[i] if with_bwd else 0.0)
                done = fwd[i] + (bwd[i] if with_bwd else 0)
                self._layer_flops[i] = (
                    fwd[i] / calls[i],
                    bwd[i] / calls[i],
                    done / timed if timed > 0 and done else None,
                )
            per_second = model / part.seconds_per_step if model and part.seconds_per_step else None
            utilization = per_second / part.peak_flops if per_second and part.peak_flops else None
            self._model = (float(model) if model else None, per_second, utilization)
        self._stats = None

    def note_updates(
        self,
        pairs: dict[int, tuple[float, ...]],
        norms: tuple[list[float | None], list[float | None], list[float | None]],
    ) -> None:
        """A sampled step's measured updates: (update², weight²) of the layers whose turn it
        was (none: not measured), and the rows of the weight norm, update norm and update
        ratio statistics after it (the aggregator's, step/builtin_statistics.py)."""
        self.step_ratios = {}
        for i, (update, weight) in pairs.items():
            self._update[i] = (update, weight)
            if weight > 0:  # (NaN weights: not above 0, left to the NaN checks)
                self.step_ratios[self._names[i]] = math.sqrt(update / weight)
        self._norms = norms
        self._stats = None

    def stats(self) -> EfficiencyStats:
        if self._stats is not None:
            return self._stats
        layers = {}
        for i, name in enumerate(self._names):
            per_call_fwd, per_call_bwd, per_second = self._layer_flops[i]
            weight_norm, update_norm, update_ratio = (row[i] for row in self._norms)
            layers[name] = LayerEfficiency(
                forward_flops=per_call_fwd,
                backward_flops=per_call_bwd,
                flops_per_second=per_second,
                weight_norm=weight_norm,
                update_norm=update_norm,
                update_ratio=update_ratio,
            )
        measured = [u for u in self._update if u is not None]
        total_w = sum(w for _, w in measured)
        flops_per_step, per_second, utilization = self._model
        self._stats = EfficiencyStats(
            layers=MappingProxyType(layers),
            flops_per_step=flops_per_step,
            flops_per_second=per_second,
            flops_utilization=utilization,
            update_ratio=math.sqrt(sum(u for u, _ in measured) / total_w)
            if measured and total_w != 0
            else None,
        )
        return self._stats
