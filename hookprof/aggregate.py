"""Host-side folding of sampled steps into running totals, and building Snapshots.

Runs on the publisher thread only; the training thread hands over finished Packets and
updates StepCounters, nothing else.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .batch import HostBatch
from .instrument import END, LAYER, OUTER_END, OUTER_START, PARENT, START, StepRecord
from .snapshot import (
    LAYER_PHASES,
    PHASES,
    STEP_DURATION_BUCKETS,
    LayerStats,
    NonFiniteEvent,
    Snapshot,
)

LOSS_LAYER = "(loss)"  # layer label of an incident seen in the loss alone


class StepCounters:
    """Per-step numbers the training thread updates on every step (sampled or not)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # uncontended: ~0.1 us per step
        self.steps = 0
        self._counts = [0] * (len(STEP_DURATION_BUCKETS) + 1)
        self._sum = 0.0
        self._last_ts: float | None = None

    def observe(self, seconds: float, wall_time: float) -> int:
        with self._lock:
            self.steps += 1
            self._counts[bisect.bisect_left(STEP_DURATION_BUCKETS, seconds)] += 1
            self._sum += seconds
            self._last_ts = wall_time
            return self.steps

    def read(self) -> tuple[int, tuple[tuple[float, int], ...], float, float | None]:
        with self._lock:
            counts, total, last, steps = list(self._counts), self._sum, self._last_ts, self.steps
        cumulative, running = [], 0
        for bound, count in zip((*STEP_DURATION_BUCKETS, math.inf), counts):
            running += count
            cumulative.append((bound, running))
        return steps, tuple(cumulative), total, last


@dataclass(slots=True)
class Packet:
    """One sampled step, handed from the training thread to the publisher."""

    step: int  # 1-based number of the step
    batch: HostBatch
    record: StepRecord | None
    grad_parts: int  # how many per-device gradient vectors the batch holds
    has_grad: frozenset[int]  # layers that had a gradient
    loss: float | None  # the loss when it was given as a Python number
    loss_in_batch: bool


def _nanmax(values: list[float]) -> float:
    """max() that lets NaN win, as torch.amax does."""
    out = -math.inf
    for v in values:
        if v != v:
            return v
        out = max(out, v)
    return out


class Aggregator:
    def __init__(self, names: list[str], module_types: list[str], rank: int, max_layers: int):
        n = len(names)
        self.names = names
        self.module_types = module_types
        self.rank = rank
        self.max_layers = max_layers
        self.sampled_steps = 0
        self.last_sampled_step: int | None = None
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.nonfinite_steps = dict.fromkeys(PHASES, 0)
        self.first_nonfinite: NonFiniteEvent | None = None
        self.fwd_total = [0.0] * n
        self.fwd_calls_total = [0] * n
        self.bwd_total = [0.0] * n
        self.bwd_calls_total = [0] * n
        self.nonfinite = {p: [0] * n for p in LAYER_PHASES}
        self._last: dict[str, list[Any]] = {}
        self._layers: MappingProxyType = MappingProxyType({})
        self._exported: tuple[str, ...] = ()
        self._dirty = True

    # ---- folding one sampled step ----

    def fold(self, packet: Packet, timer: Any) -> None:
        n = len(self.names)
        calls = [0] * n
        fwd = [0.0] * n
        bwd = [0.0] * n
        absmax: list[list[float]] = [[] for _ in range(n)]
        zeros = [0.0] * n
        numel = [0] * n
        first_forward_bad: int | None = None
        bwd_start_of_layer: dict[int, float] = {}

        rec = packet.record
        if rec is not None:
            try:
                call_fwd, call_bwd, bwd_start = self._resolve_times(rec, timer)
            finally:
                timer.release(rec.tokens())
            for call, entry in enumerate(rec.calls):
                layer = entry[LAYER]
                calls[layer] += 1
                fwd[layer] += call_fwd[call]
                if call in call_bwd:
                    bwd[layer] += call_bwd[call]
                    self.bwd_calls_total[layer] += 1
                if call in bwd_start:
                    prev = bwd_start_of_layer.get(layer, math.inf)
                    bwd_start_of_layer[layer] = min(prev, bwd_start[call])
            lows, highs = packet.batch.get("act_min"), packet.batch.get("act_max")
            nonzeros = iter(packet.batch.get("nonzero"))
            for (call, _, _, nz_tensor, count), low, high in zip(rec.act, lows, highs):
                layer = rec.calls[call][LAYER]
                m = _nanmax([-low, high])
                absmax[layer].append(m)
                if nz_tensor is not None:
                    zeros[layer] += count - next(nonzeros)
                    numel[layer] += count
                if not math.isfinite(m) and (first_forward_bad is None or call < first_forward_bad):
                    first_forward_bad = call

        squares = [0.0] * n
        for part in range(packet.grad_parts):
            for i, v in enumerate(packet.batch.get(("grad_sq", part))):
                squares[i] += v

        loss = packet.loss
        if packet.loss_in_batch:
            loss = packet.batch.get("loss")[0]

        # --- fold into running totals ---
        bad_fwd = [i for i in range(n) if absmax[i] and not math.isfinite(_nanmax(absmax[i]))]
        bad_bwd = [i for i in sorted(packet.has_grad) if not math.isfinite(squares[i])]
        loss_bad = loss is not None and not math.isfinite(loss)
        for i in bad_fwd:
            self.nonfinite["forward"][i] += 1
        for i in bad_bwd:
            self.nonfinite["backward"][i] += 1
        for phase, bad in (("forward", bad_fwd), ("backward", bad_bwd), ("loss", loss_bad)):
            if bad:
                self.nonfinite_steps[phase] += 1
        if self.first_nonfinite is None:
            self.first_nonfinite = self._first_event(
                packet.step, rec, first_forward_bad, bad_bwd, bwd_start_of_layer, loss_bad
            )

        for i in range(n):
            self.fwd_total[i] += fwd[i]
            self.fwd_calls_total[i] += calls[i]
            self.bwd_total[i] += bwd[i]
        self._last = {
            "calls": calls,
            "fwd": fwd,
            "bwd": bwd,
            "grad": [math.sqrt(squares[i]) if i in packet.has_grad else None for i in range(n)],
            "zero_ratio": [zeros[i] / numel[i] if numel[i] else None for i in range(n)],
            "absmax": [_nanmax(absmax[i]) if absmax[i] else None for i in range(n)],
        }
        if packet.has_grad:
            self.grad_norm = math.sqrt(sum(squares[i] for i in packet.has_grad))
        if loss is not None:
            self.loss = loss
        self.sampled_steps += 1
        self.last_sampled_step = packet.step
        self._dirty = True  # layers are rebuilt when the next snapshot is taken

    def _resolve_times(
        self, rec: StepRecord, timer: Any
    ) -> tuple[list[float], dict[int, float], dict[int, float]]:
        """Per forward call: exclusive forward seconds; per call with a backward: exclusive
        backward seconds and backward start (seconds from rec.ref)."""

        def at(token: Any) -> float:
            return timer.seconds(rec.ref, token)

        ncalls = len(rec.calls)
        span = [0.0] * ncalls
        outer = [0.0] * ncalls
        for c, entry in enumerate(rec.calls):
            if entry[END] is not None and entry[START] is not None:
                span[c] = max(at(entry[END]) - at(entry[START]), 0.0)
                if entry[OUTER_END] is not None:
                    outer[c] = max(at(entry[OUTER_END]) - at(entry[OUTER_START]), 0.0)
                else:
                    outer[c] = span[c]

        start: dict[int, float] = {}
        for c, tok in rec.bwd_out:
            start[c] = min(start.get(c, math.inf), at(tok))
        end_of: dict[int, float] = {}
        for c, tok in rec.bwd_in:
            end_of[c] = max(end_of.get(c, -math.inf), at(tok))
        param_end: dict[int, float] = {}
        for layer, tok in rec.param_done:
            param_end[layer] = max(param_end.get(layer, -math.inf), at(tok))
        bspan: dict[int, float] = {}
        for c, s in start.items():
            if c >= ncalls:
                continue
            e = end_of.get(c, param_end.get(rec.calls[c][LAYER]))
            if e is not None and e >= s:
                bspan[c] = e - s

        # exclusive times: a parent call (a module that owns parameters and has children)
        # counts neither its instrumented children's time nor our hook work around them
        fwd_excl = list(span)
        bwd_excl = dict(bspan)
        for c in range(ncalls):
            parent = rec.calls[c][PARENT]
            if parent < 0:
                continue
            fwd_excl[parent] -= outer[c]
            if parent in bwd_excl and c in bspan:
                bwd_excl[parent] -= bspan[c]
        fwd_excl = [max(v, 0.0) for v in fwd_excl]
        bwd_excl = {c: max(v, 0.0) for c, v in bwd_excl.items()}
        return fwd_excl, bwd_excl, start

    def _first_event(
        self,
        step: int,
        rec: StepRecord | None,
        first_forward_bad: int | None,
        bad_bwd: list[int],
        bwd_start_of_layer: dict[int, float],
        loss_bad: bool,
    ) -> NonFiniteEvent | None:
        if rec is not None and first_forward_bad is not None:
            layer = rec.calls[first_forward_bad][LAYER]
            return NonFiniteEvent(self.names[layer], "forward", step)
        if bad_bwd:
            # the first to go bad in backward: earliest backward start when it was timed,
            # else the last layer in module order (backward runs roughly in reverse)
            first = min(bad_bwd, key=lambda i: (bwd_start_of_layer.get(i, math.inf), -i))
            return NonFiniteEvent(self.names[first], "backward", step)
        if loss_bad:
            return NonFiniteEvent(LOSS_LAYER, "loss", step)
        return None

    # ---- snapshots ----

    def _rebuild_layers(self) -> None:
        n = len(self.names)
        last = self._last
        layers = {}
        for i in range(n):
            layers[self.names[i]] = LayerStats(
                name=self.names[i],
                module=self.module_types[i],
                calls=last["calls"][i] if last else 0,
                forward_seconds=last["fwd"][i] if last else 0.0,
                backward_seconds=last["bwd"][i] if last else 0.0,
                grad_norm=last["grad"][i] if last else None,
                activation_zero_ratio=last["zero_ratio"][i] if last else None,
                activation_abs_max=last["absmax"][i] if last else None,
                forward_seconds_total=self.fwd_total[i],
                forward_calls_total=self.fwd_calls_total[i],
                backward_seconds_total=self.bwd_total[i],
                backward_calls_total=self.bwd_calls_total[i],
                nonfinite=MappingProxyType({p: self.nonfinite[p][i] for p in LAYER_PHASES}),
            )
        self._layers = MappingProxyType(layers)
        self._exported = self._select_exported()

    def _select_exported(self) -> tuple[str, ...]:
        n = len(self.names)
        if n <= self.max_layers:
            return tuple(self.names)
        bad = {i for i in range(n) if any(self.nonfinite[p][i] for p in LAYER_PHASES)}
        room = max(self.max_layers - len(bad), 0)
        by_time = sorted(
            (i for i in range(n) if i not in bad),
            key=lambda i: self.fwd_total[i] + self.bwd_total[i],
            reverse=True,
        )
        keep = sorted(bad | set(by_time[:room]))
        return tuple(self.names[i] for i in keep)

    def snapshot(self, counters: StepCounters, internal_errors: int) -> Snapshot:
        if self._dirty:
            self._rebuild_layers()
            self._dirty = False
        steps, buckets, total, last_ts = counters.read()
        return Snapshot(
            rank=self.rank,
            step=steps,
            sampled_steps=self.sampled_steps,
            last_sampled_step=self.last_sampled_step,
            step_duration_buckets=buckets,
            step_duration_sum=total,
            last_step_timestamp=last_ts,
            loss=self.loss,
            grad_norm=self.grad_norm,
            nonfinite_steps=MappingProxyType(dict(self.nonfinite_steps)),
            skipped_steps=0,
            internal_errors=internal_errors,
            layers=self._layers,
            exported_layers=self._exported,
            first_nonfinite=self.first_nonfinite,
        )
