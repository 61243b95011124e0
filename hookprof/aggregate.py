"""Host-side folding of sampled steps into running totals, and building Snapshots.

Runs on the publisher thread only; the training thread hands over finished Packets and
updates StepCounters, nothing else.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .batch import HostBatch
from .nonfinite import PHASE_INDEX, fold_counters
from .instrument import END, LAYER, OUTER_END, OUTER_START, PARENT, START, StepRecord
from .snapshot import (
    PHASES,
    STEP_DURATION_BUCKETS,
    LayerStats,
    NonFiniteEvent,
    Snapshot,
)

LOSS_LAYER = "(loss)"  # layer label of an incident seen in the loss alone
GRADSCALER_LAYER = "(gradscaler)"  # layer label of persistent GradScaler skipping
FLAG_KINDS = ("vanishing", "exploding")


class StepCounters:
    """Per-step numbers the training thread updates on every step (sampled or not)."""

    def __init__(self, max_skipped_steps: int = 10) -> None:
        self._lock = threading.Lock()  # uncontended: ~0.1 us per step
        self.steps = 0
        self._counts = [0] * (len(STEP_DURATION_BUCKETS) + 1)
        self._sum = 0.0
        self._last_ts: float | None = None
        self._max_skips = max_skipped_steps
        self.skipped = 0
        self._skips_in_a_row = 0
        self.persistent_skips = 0  # skipped steps beyond max_skipped_steps in a row

    def observe(self, seconds: float, wall_time: float, skipped: bool = False) -> int:
        with self._lock:
            self.steps += 1
            self._counts[bisect.bisect_left(STEP_DURATION_BUCKETS, seconds)] += 1
            self._sum += seconds
            self._last_ts = wall_time
            if skipped:
                self.skipped += 1
                self._skips_in_a_row += 1
                if self._skips_in_a_row > self._max_skips:
                    self.persistent_skips += 1
            else:
                self._skips_in_a_row = 0
            return self.steps

    def read(self) -> tuple[int, tuple[tuple[float, int], ...], float, float | None, int, int]:
        with self._lock:
            counts, total, last, steps = list(self._counts), self._sum, self._last_ts, self.steps
            skipped, persistent = self.skipped, self.persistent_skips
        cumulative, running = [], 0
        for bound, count in zip((*STEP_DURATION_BUCKETS, math.inf), counts):
            running += count
            cumulative.append((bound, running))
        return steps, tuple(cumulative), total, last, skipped, persistent


@dataclass(slots=True)
class ForwardFinding:
    producers: list[str]  # layers with finite inputs and non-finite outputs, in call order
    propagators: list[str]  # layers with non-finite inputs and outputs
    bwd_start_of_layer: dict[int, float]


@dataclass(slots=True)
class Packet:
    """What the training thread hands the publisher: a sampled step, a replayed forward
    (record, not sampled) or a drain of the non-finite counters alone (neither)."""

    step: int  # 1-based number of the step
    batch: HostBatch | None = None  # set when the device-to-host copy is started
    record: StepRecord | None = None
    sampled: bool = True
    grad_parts: int = 0  # how many per-device gradient vectors the batch holds
    has_grad: frozenset[int] = frozenset()  # layers that had a gradient
    act_order: list[int] = field(default_factory=list)  # record.act index of each value
    counter_parts: int = 0  # how many non-finite counter blocks the batch holds
    loss: float | None = None  # the loss when it was given as a Python number
    loss_in_batch: bool = False


def _nanmax(values: list[float]) -> float:
    """max() that lets NaN win, as torch.amax does."""
    out = -math.inf
    for v in values:
        if v != v:
            return v
        out = max(out, v)
    return out


class Aggregator:
    def __init__(self, names: list[str], module_types: list[str], rank: int, max_layers: int,
                 grad_norm_bounds: tuple[float, float] = (1e-6, 1e3)):
        n = len(names)
        self.grad_norm_bounds = grad_norm_bounds
        # sampled steps on which a layer's gradient norm was below / above the bounds
        self.flagged = {k: [0] * n for k in FLAG_KINDS}
        self.flagged_steps = dict.fromkeys(FLAG_KINDS, 0)
        self.names = names
        self.module_types = module_types
        self.rank = rank
        self.max_layers = max_layers
        self.sampled_steps = 0
        self.last_sampled_step: int | None = None
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.first_nonfinite: NonFiniteEvent | None = None
        self.counters = fold_counters([], n)  # the device counters as last drained
        self._replayed: tuple[int, ForwardFinding] | None = None
        self.fwd_total = [0.0] * n
        self.fwd_calls_total = [0] * n
        self.bwd_total = [0.0] * n
        self.bwd_calls_total = [0] * n
        self.recompute_total = [0.0] * n  # activation checkpointing's forward recomputation
        self.recompute_calls_total = [0] * n
        self.fwd_nonfinite = [0] * n  # per layer, from sampled and replayed steps
        self._last: dict[str, list[Any]] = {}
        self._layers: MappingProxyType = MappingProxyType({})
        self._exported: tuple[str, ...] = ()
        self._dirty = True

    # ---- folding one sampled step ----

    def fold(self, packet: Packet, timer: Any) -> None:
        n = len(self.names)
        if packet.counter_parts:
            parts = [packet.batch.get(("counters", k)) for k in range(packet.counter_parts)]
            self.counters = fold_counters(parts, n)
        if packet.record is None and not packet.sampled:  # a drain of the counters alone
            self._update_incident(packet.step, None)
            self._dirty = True
            return
        # a replayed forward (packet.sampled False): its checks count, its timings do not

        calls = [0] * n
        fwd = [0.0] * n
        bwd = [0.0] * n
        recompute = [0.0] * n
        recompute_calls = [0] * n
        absmax: list[list[float]] = [[] for _ in range(n)]
        zeros = [0.0] * n
        numel = [0] * n
        forward = None

        rec = packet.record
        if rec is not None:
            try:
                call_fwd, call_bwd, bwd_start = self._resolve_times(rec, timer)
            finally:
                timer.release(rec.tokens())
            for call, entry in enumerate(rec.calls):
                layer = entry[LAYER]
                if call in rec.recompute:  # reported apart, never as forward time
                    recompute_calls[layer] += 1
                    recompute[layer] += call_fwd[call]
                else:
                    calls[layer] += 1
                    fwd[layer] += call_fwd[call]
                if call in call_bwd and packet.sampled:
                    bwd[layer] += call_bwd[call]
                    self.bwd_calls_total[layer] += 1
            # activation values back in record order: act index -> (abs max, non-zeros)
            lows, highs = packet.batch.get("act_min"), packet.batch.get("act_max")
            nonzero_values = iter(packet.batch.get("nonzero"))
            act_max: dict[int, float] = {}
            for position, i in enumerate(packet.act_order):
                call, _, _, nz_tensor, count = rec.act[i]
                act_max[i] = m = _nanmax([-lows[position], highs[position]])
                if call < 0:
                    continue  # an input's check, not a layer output
                layer = rec.calls[call][LAYER]
                absmax[layer].append(m)
                if nz_tensor is not None:
                    zeros[layer] += count - next(nonzero_values)
                    numel[layer] += count
            forward = self._forward_roles(rec, act_max, bwd_start)

        squares = [0.0] * n
        for part in range(packet.grad_parts):
            for i, v in enumerate(packet.batch.get(("grad_sq", part))):
                squares[i] += v

        loss = packet.loss
        if packet.loss_in_batch:
            loss = packet.batch.get("loss")[0]

        for i in range(n):
            if absmax[i] and not math.isfinite(_nanmax(absmax[i])):
                self.fwd_nonfinite[i] += 1
        if not packet.sampled and forward is not None:
            self._replayed = (packet.step, forward)
        self._update_incident(packet.step, forward)
        self._dirty = True
        if not packet.sampled:
            return
        for i in range(n):
            self.fwd_total[i] += fwd[i]
            self.fwd_calls_total[i] += calls[i]
            self.bwd_total[i] += bwd[i]
            self.recompute_total[i] += recompute[i]
            self.recompute_calls_total[i] += recompute_calls[i]
        previous = self._last
        checked = rec is not None and bool(rec.act)
        self._last = {
            "calls": calls,
            "fwd": fwd,
            "recompute": recompute,
            "bwd": bwd,
            "grad": [math.sqrt(squares[i]) if i in packet.has_grad else None for i in range(n)],
            # a sampled step without activation statistics (activation_interval_s) keeps
            # the last ones, so the gauges do not blink out between them
            "zero_ratio": [zeros[i] / numel[i] if numel[i] else None for i in range(n)]
            if checked or not previous else previous["zero_ratio"],
            "absmax": [_nanmax(absmax[i]) if absmax[i] else None for i in range(n)]
            if checked or not previous else previous["absmax"],
        }
        if packet.has_grad:
            self.grad_norm = math.sqrt(sum(squares[i] for i in packet.has_grad))
            self._flag_gradients(squares, packet.has_grad)
        if loss is not None:
            self.loss = loss
        self.sampled_steps += 1
        self.last_sampled_step = packet.step
        self._dirty = True  # layers are rebuilt when the next snapshot is taken

    def _flag_gradients(self, squares: list[float], has_grad: frozenset[int]) -> None:
        low, high = self.grad_norm_bounds
        seen = dict.fromkeys(FLAG_KINDS, False)
        for i in has_grad:
            norm = math.sqrt(squares[i])
            if not math.isfinite(norm):
                continue  # a NaN/Inf is an incident of its own, not an explosion
            kind = "vanishing" if norm < low else "exploding" if norm > high else None
            if kind is not None:
                self.flagged[kind][i] += 1
                seen[kind] = True
        for kind, hit in seen.items():
            self.flagged_steps[kind] += hit

    def _forward_roles(
        self, rec: StepRecord, act_max: dict[int, float], bwd_start: dict[int, float]
    ) -> ForwardFinding:
        """Which calls of a sampled step produced a NaN/Inf (finite inputs, non-finite
        output) and which passed one on (non-finite inputs); plus the backward order."""
        out_bad: dict[int, bool] = {}
        for i, entry in enumerate(rec.act):
            call = entry[0]
            if call >= 0 and not math.isfinite(act_max[i]):
                out_bad[call] = True
        in_bad: dict[int, bool] = {}
        for call, i in rec.inputs:
            if not math.isfinite(act_max[i]):
                in_bad[call] = True
        producers, propagators = [], []
        for call in sorted(out_bad):
            layer = self.names[rec.calls[call][LAYER]]
            (propagators if in_bad.get(call) else producers).append(layer)
        start_of_layer: dict[int, float] = {}
        for call, t in bwd_start.items():
            layer = rec.calls[call][LAYER]
            start_of_layer[layer] = min(start_of_layer.get(layer, math.inf), t)
        return ForwardFinding(producers, propagators, start_of_layer)

    def _update_incident(self, step: int, forward: ForwardFinding | None) -> None:
        """Keep the first NaN/Inf of the run: its step and phase from the device counters
        (exact, every step), its layer once known."""
        event = self.first_nonfinite
        if event is not None and event.layer is not None:
            return
        c = self.counters
        firsts = [(c["phase_first"][PHASE_INDEX[p]], order, p)
                  for order, p in enumerate(("forward", "loss", "backward"))
                  if c["phase_first"][PHASE_INDEX[p]] >= 0]
        if not firsts:
            return
        first_step, _, phase = min(firsts)
        layer, propagators = None, ()
        if phase == "forward":
            seen = [(step, forward)] if forward is not None else []
            if self._replayed is not None:
                seen.append(self._replayed)  # the incident step's own forward, replayed
            for at, finding in sorted(seen, key=lambda sf: sf[0] != first_step):
                poisoned = 0 <= c["phase_first"][PHASE_INDEX["backward"]] < at
                # a producer seen on a later step counts only if no non-finite gradient
                # was applied in between: after that, every layer's parameters are suspect
                if finding.producers and (at == first_step or not poisoned):
                    layer, propagators = finding.producers[0], tuple(finding.propagators)
                    break
        elif phase == "loss":
            layer = LOSS_LAYER
        else:
            bad = [i for i, s in enumerate(c["layer_first"]) if s == first_step]
            if bad:
                # the first to go bad in backward: earliest backward start when it was timed
                # on this step, else the last layer in module order (backward runs roughly
                # in reverse)
                starts = forward.bwd_start_of_layer if forward is not None and step == first_step else {}
                first = min(bad, key=lambda i: (starts.get(i, math.inf), -i))
                layer = self.names[first]
                propagators = tuple(self.names[i] for i in bad if i != first)
        self.first_nonfinite = NonFiniteEvent(layer, phase, first_step, propagators)

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
        end_of: dict[int, float] = {}
        for roles, tok in rec.grad_ready:
            t = at(tok)
            for c, is_output in roles:
                if is_output:  # the gradient reached c's output: c's backward starts
                    start[c] = min(start.get(c, math.inf), t)
                else:  # c's input gradient is produced: c's backward ends
                    end_of[c] = max(end_of.get(c, -math.inf), t)
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
                recompute_seconds=last["recompute"][i] if last else 0.0,
                recompute_seconds_total=self.recompute_total[i],
                recompute_calls_total=self.recompute_calls_total[i],
                nonfinite=MappingProxyType(self._layer_nonfinite(i)),
                gradient_flags=MappingProxyType({k: self.flagged[k][i] for k in FLAG_KINDS}),
            )
        self._layers = MappingProxyType(layers)
        self._exported = self._select_exported()

    def _select_exported(self) -> tuple[str, ...]:
        n = len(self.names)
        if n <= self.max_layers:
            return tuple(self.names)
        bad = {i for i in range(n) if any(self._layer_nonfinite(i).values())}
        room = max(self.max_layers - len(bad), 0)
        by_time = sorted(
            (i for i in range(n) if i not in bad),
            key=lambda i: self.fwd_total[i] + self.bwd_total[i],
            reverse=True,
        )
        keep = sorted(bad | set(by_time[:room]))
        return tuple(self.names[i] for i in keep)

    def _layer_nonfinite(self, i: int) -> dict[str, int]:
        # forward: sampled steps' output checks; backward: the device counters (every step)
        return {"forward": self.fwd_nonfinite[i], "backward": self.counters["layer_bad"][i]}

    def snapshot(self, counters: StepCounters, internal_errors: int) -> Snapshot:
        if self._dirty:
            self._rebuild_layers()
            self._dirty = False
        steps, buckets, total, last_ts, skipped, persistent_skips = counters.read()
        phase_bad = self.counters["phase_bad"]
        nonfinite_steps = {p: phase_bad[PHASE_INDEX[p]] for p in PHASES}
        nonfinite_steps["backward"] += persistent_skips  # skipping that never stops
        first = self.first_nonfinite
        if first is None and persistent_skips:
            first = NonFiniteEvent(GRADSCALER_LAYER, "backward", steps)
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
            nonfinite_steps=MappingProxyType(nonfinite_steps),
            skipped_steps=skipped,
            internal_errors=internal_errors,
            layers=self._layers,
            exported_layers=self._exported,
            first_nonfinite=first,
            gradient_flagged_steps=MappingProxyType(dict(self.flagged_steps)),
        )
