"""Host-side folding of sampled steps into running totals, and building Snapshots.

Runs on the publisher thread only; the training thread hands over finished Packets and
updates StepCounters, nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from hookprof.device.identity import device_name
from hookprof.device.timing import Timer
from hookprof.efficiency.figures import EfficiencyTotals
from hookprof.integrity.fingerprint import combine, parameter_change
from hookprof.integrity.replay_check import ReplayVerdicts
from hookprof.integrity.spike_replay import SpikeComparison, SpikeReplays
from hookprof.nonfinite.attribution import Attribution, ForwardFinding, forward_roles
from hookprof.nonfinite.detector import PHASE_INDEX, fold_counters, merge_counters
from hookprof.nonfinite.guard import fold_skips
from hookprof.phases.device import DevicePhaseTotals, device_phase_seconds
from hookprof.publish.recent import RecentPerCall
from hookprof.publish.spikes import (
    DEFAULT_THRESHOLDS,
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    UPDATE_RATIO_JUMP,
    SpikeWatch,
)
from hookprof.snapshot import (
    PHASES,
    DroppedNonFinite,
    LayerStatisticValues,
    LayerStats,
    NonFiniteEvent,
    ParameterChange,
    ParameterFingerprint,
    Snapshot,
    layer_series,
    timing_series,
)
from hookprof.step.builtin_statistics import (
    ABS_MAX,
    UPDATE_NORM,
    UPDATE_RATIO,
    WEIGHT_NORM,
    ZERO_RATIO,
)
from hookprof.step.record import Packet, StepCounters, StepRecord
from hookprof.step.series import StepValue, decode
from hookprof.step.statistics import (
    EXTREMES,
    OUTPUT,
    PARAMETERS,
    UPDATE,
    applies,
    fold_calls,
    source_of,
)

REPLAY_UNAVAILABLE_DTENSOR = (
    "the model has FSDP2 / tensor-parallel (DTensor) parameters: a replay on one rank "
    "would start collectives the other ranks never join"
)
GRADSCALER_LAYER = "(gradscaler)"  # layer label of persistent GradScaler skipping
FLAG_KINDS = ("vanishing", "exploding")


class StepFigures:
    """One step's per-layer figures, read from its record (lists indexed by layer; the
    times by row: the layers, then the container modules, timed when a container is a
    compiled region)."""

    def __init__(self, n: int, rows: int):
        self.calls = [0] * rows
        self.fwd = [0.0] * rows  # exclusive forward seconds
        self.bwd = [0.0] * rows  # exclusive backward seconds
        self.bwd_calls = [0] * rows
        self.recompute = [0.0] * rows  # activation checkpointing's forward recomputation
        self.recompute_calls = [0] * rows
        self.nonfinite_outputs: set[int] = set()  # layers with an output the check found bad
        # (min, max) of each output, in the order they were checked: what the statistics of
        # source "extremes" fold (step/statistics.py)
        self.extremes: list[list[tuple[float, ...]]] = [[] for _ in range(n)]
        self.checked = False  # the step had activation statistics (and output checks)
        self.finding: ForwardFinding | None = None
        self.device_phases: tuple[float, ...] | None = None  # device seconds per step phase


def _nanmax(values: list[float]) -> float:
    """max() that lets NaN win, as torch.amax does."""
    out = -math.inf
    for v in values:
        if v != v:
            return v
        out = max(out, v)
    return out


class Aggregator:
    @classmethod
    def for_table(
        cls,
        table: Any,
        rank: int,
        config: Any,
        *,
        efficiency: EfficiencyTotals | None,
        device_phases: DevicePhaseTotals | None,
        statistics: tuple[Any, ...] = (),
        replica_group: str = "",
        report: Callable[[str, BaseException], None] | None = None,
    ) -> Aggregator:
        """The totals of a model's layer table, with their slice of the config (max_layers,
        max_layer_series, vanishing_grad_norm, exploding_grad_norm)."""
        return cls(
            table.names,
            [layer.module_type for layer in table.layers],
            rank,
            config.max_layers,
            (config.vanishing_grad_norm, config.exploding_grad_norm),
            container_names=[name for name, _ in table.containers],
            container_types=[
                type(m).__name__ if m is not None else "" for _, m in table.containers
            ],
            max_series=config.max_layer_series,
            detailed=config.detailed_layers,
            efficiency=efficiency,
            device_phases=device_phases,
            statistics=statistics,
            report=report,
            # the layers each statistic of source "extremes" folds (its applies_to)
            extremes_reach={
                k: frozenset(
                    layer.index for layer in table.layers if applies(s, layer.module, report)
                )
                for k, s in enumerate(statistics)
                if source_of(s) == EXTREMES
            },
            device=device_name(table.param_devices()),
            # FSDP2 / tensor parallel: a replay on one rank would start collectives
            # the other ranks never join (nonfinite/checks.py never runs one)
            replay_unavailable=REPLAY_UNAVAILABLE_DTENSOR if table.has_dtensor_params else None,
            gradients_every_step=config.nonfinite_check == "all",
            spikes=SpikeWatch(
                config.spike_window,
                {
                    LOSS_SPIKE: config.loss_spike_z,
                    GRAD_NORM_SPIKE: config.grad_norm_spike_z,
                    UPDATE_RATIO_JUMP: config.update_ratio_jump_z,
                }
                if config.spike_detection
                else dict.fromkeys(DEFAULT_THRESHOLDS, math.inf),  # never above
            ),
            replica_group=replica_group,
            spike_replay=config.spike_replay,
        )

    def __init__(
        self,
        names: list[str],
        module_types: list[str],
        rank: int,
        max_layers: int,
        grad_norm_bounds: tuple[float, float] = (1e-6, 1e3),
        container_names: Sequence[str] = (),
        *,
        container_types: Sequence[str] = (),
        max_series: int | None = None,
        detailed: int | None = None,
        efficiency: EfficiencyTotals | None = None,
        device_phases: DevicePhaseTotals | None = None,
        statistics: tuple[Any, ...] = (),
        device: str = "cpu",
        replay_unavailable: str | None = None,
        gradients_every_step: bool = True,
        spikes: SpikeWatch | None = None,
        replica_group: str = "",
        report: Callable[[str, BaseException], None] | None = None,
        extremes_reach: Mapping[int, frozenset[int]] | None = None,
        spike_replay: bool = False,
    ):
        n = len(names)
        # names of recorded calls: layers, then container modules (hooked by the replay, and
        # timed on sampled steps when one is a compiled region: regional compilation)
        self._call_names = list(names) + list(container_names)
        self._row_types = list(module_types) + list(container_types)
        rows = len(self._call_names)
        # the rows past the layers that have been timed (the compiled regions), in the order
        # they first were: the snapshot's, the page's and the history's one list of them
        self.region_rows: list[int] = []
        self.grad_norm_bounds = grad_norm_bounds
        # sampled steps on which a layer's gradient norm was below / above the bounds
        self.flagged = {k: [0] * n for k in FLAG_KINDS}
        self.flagged_steps = dict.fromkeys(FLAG_KINDS, 0)
        self.names = names
        self.module_types = module_types
        self.rank = rank
        self.max_layers = max_layers
        self.max_series = max_series  # per-layer series on the page (None: layers only)
        # the replica check's last fingerprint, and the replica group it is of
        self.fingerprint: ParameterFingerprint | None = None
        self.replica_group = replica_group
        # check steps whose parameters changed between the forward and the update, and the
        # last (counted from 0 when the checks are on: a group is given)
        self.parameter_changes: int | None = 0 if replica_group else None
        self.parameter_change: ParameterChange | None = None
        self.parameter_watches = {"compared": 0, "not_compared": 0} if replica_group else {}
        # the replay check's verdicts, when the checks are on (a group is given)
        self.replay = ReplayVerdicts(names) if replica_group else None
        # the spikes' replays' verdicts (Config.spike_replay, integrity/spike_replay.py)
        self.spike_replays = SpikeReplays() if spike_replay else None
        # layers with every figure, beyond the non-finite ones (None: all); the others on the
        # page have their time alone (Config.detailed_layers)
        self.detailed = detailed
        self.sampled_steps = 0
        self.sampled_step_seconds = 0.0  # their wall time, summed (the layers' window)
        self.last_sampled_step: int | None = None
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self._attribution = Attribution(
            names,
            device=device,
            replay_unavailable=replay_unavailable,
            gradients_every_step=gradients_every_step,
        )
        self.counters = fold_counters([], n)  # the device counters, every drain merged
        # guard.SkipCounters as last drained: name -> (count, persistent)
        self.device_counts: dict[str, tuple[int, int]] = {}
        self.fwd_total = [0.0] * rows  # by row: compiled regions' times too
        self.fwd_calls_total = [0] * rows
        self.bwd_total = [0.0] * rows
        self.bwd_calls_total = [0] * rows
        # each row's median time per call over its last few sampled steps (recent.py)
        self.recent_fwd = RecentPerCall(rows)
        self.recent_bwd = RecentPerCall(rows)
        self.recompute_total = [0.0] * rows  # activation checkpointing's forward recomputation
        self.recompute_calls_total = [0] * rows
        self.fwd_nonfinite = [0] * n  # per layer, from sampled and replayed steps
        self._last: dict[str, list[Any]] = {}
        self._layers: MappingProxyType = MappingProxyType({})
        self._exported: tuple[str, ...] = ()
        self._timed: tuple[str, ...] = ()  # on the page with their time alone
        self._dirty = True
        self.efficiency = efficiency  # when its figures are measured
        self.device_phases = device_phases  # with a device timer
        # loss and gradient-norm spikes in the every-step series (publish/spikes.py)
        self.spikes = spikes if spikes is not None else SpikeWatch(200, DEFAULT_THRESHOLDS)
        # the last packet's every-step values, decoded once for the spikes and the history
        self._series: tuple[Packet | None, list[StepValue]] = (None, [])
        # the per-layer statistics (step/statistics.py: hookprof's built-in ones, then the
        # user's), and per layer its value folded from its calls on the last sampled step
        # that had activation statistics (an output's), or at the last sampled step's end (a
        # parameter statistic's). `report(part, exc)` hears of a fold that raised
        self.statistics = tuple(statistics)
        self._sources = [source_of(s) for s in statistics]
        self.statistic_values: list[list[float | None]] = [[None] * n for _ in statistics]
        self._has_parameter_statistics = PARAMETERS in self._sources
        # statistic index -> the layers it folds, of those of source "extremes" (all of them
        # without a reach given)
        self._extremes_reach = (
            dict(extremes_reach)
            if extremes_reach is not None
            else {k: frozenset(range(n)) for k, of in enumerate(self._sources) if of == EXTREMES}
        )
        index = {s.name: k for k, s in enumerate(statistics)}
        self._abs_max, self._zero_ratio = index.get(ABS_MAX), index.get(ZERO_RATIO)
        # the built-in update statistics: their rows are LayerEfficiency's, the ratio's
        # (update², weight²) the model-wide update ratio's and the jump judge's
        self._norms = tuple(index.get(name) for name in (WEIGHT_NORM, UPDATE_NORM, UPDATE_RATIO))
        self._report = report

    # ---- folding one packet ----

    def fold(self, packet: Packet, timer: Timer) -> None:
        """Fold one packet in: a drain of the non-finite counters alone, a replayed forward
        (its checks count, its timings do not) or a sampled step."""
        if packet.series is not None:  # every step's loss and norm since the last drain
            self.spikes.observe(self.series_of(packet))
        # the counters are cumulative: a drain folded after a newer one takes nothing back
        if packet.counter_parts:
            parts = [packet.batch.get(("counters", k)) for k in range(packet.counter_parts)]
            dropped = [packet.batch.get(("dropped", k)) for k in range(packet.dropped_parts)]
            self.counters = merge_counters(
                self.counters, fold_counters(parts, len(self.names), dropped)
            )
            self._attribution.counters(self.counters)
        for name, n_parts in packet.count_parts.items():
            new = fold_skips([packet.batch.get((name, k)) for k in range(n_parts)])
            old = self.device_counts.get(name, (0, 0))
            self.device_counts[name] = (max(old[0], new[0]), max(old[1], new[1]))
        if packet.not_replayed is not None:
            self._attribution.not_replayed(packet.step, packet.not_replayed)
        if packet.capsule is not None:
            self._attribution.capsule_written(packet.capsule)
        if packet.replay_check is not None:
            flags = [v for k in range(packet.replay_parts) for v in packet.batch.get(("replay", k))]
            if isinstance(packet.replay_check, SpikeComparison):  # (a spike's replay)
                if self.spike_replays is not None:
                    self._judge_spike_replay(packet.replay_check, flags)
            elif self.replay is not None:
                self.replay.judge(packet.replay_check, flags)
            self._dirty = True
        if packet.fingerprint_parts:  # (integrity/replicas.py)
            halves = [
                v
                for k in range(packet.fingerprint_parts)
                for v in packet.batch.get(("fingerprint", k))
            ]
            self.fingerprint = ParameterFingerprint(
                packet.step, combine(halves), self.replica_group
            )
            self._judge_changes(packet)
            self._dirty = True
        if packet.record is None and not packet.sampled:  # a drain of the counters alone
            loss = self.loss_of(packet)
            if loss is not None and packet.step == self.last_sampled_step:
                self.loss = loss  # prof.step(loss) after the optimizer ended a sampled step
            self._attribution.decide()
            self._dirty = True
            return
        figures = self._read_record(packet, timer)
        for i in figures.nonfinite_outputs:
            self.fwd_nonfinite[i] += 1
        if figures.finding is not None:
            if packet.sampled:
                backward_bad = any(
                    not math.isfinite(v)
                    for k in range(packet.grad_parts)
                    for v in packet.batch.get(("grad_sq", k))
                )
                self._attribution.sampled(packet.step, figures.finding, backward_bad)
            else:
                self._attribution.replayed(packet.step, figures.finding, packet.replay_moved)
        self._attribution.decide()
        self._dirty = True
        if packet.sampled:
            self._add_sampled_step(packet, figures)

    def _judge_changes(self, packet: Packet) -> None:
        """A check step's parameters changed between its forward and its update? (counted)"""
        if self.parameter_changes is None:
            return
        result = "compared" if packet.changed_parts else "not_compared"
        self.parameter_watches[result] += 1
        if not packet.changed_parts:
            return
        values = [v for k in range(packet.changed_parts) for v in packet.batch.get(("changed", k))]
        change = parameter_change(packet.step, values, packet.changed_names, time.time())
        if change is not None:
            self.parameter_changes += 1
            self.parameter_change = change

    def _read_record(self, packet: Packet, timer: Timer) -> StepFigures:
        """Per-layer figures of the packet's record: times resolved from the timer's tokens
        (which go back to its pool), activation reductions read from the batch."""
        rows = len(self._call_names)
        figures = StepFigures(len(self.names), rows)
        rec = packet.record
        if rec is None:  # a sampled step without per-layer hooks (a compiled model)
            return figures
        try:
            call_fwd, call_bwd, bwd_start, at = self._resolve_times(rec, timer)
            if rec.phase_marks:  # resolved with the step's other tokens (device_phases.py)
                figures.device_phases = device_phase_seconds(rec.phase_marks, at)
        finally:
            timer.release(rec.tokens())
        n = len(self.names)
        for call_id, call in enumerate(rec.calls):
            layer = call.layer
            if layer >= rows or call_id in rec.untimed:
                continue  # (not a row); a compiled region's call that compiled, or a re-run's
            if call_id in rec.recompute:  # reported apart, never as forward time
                figures.recompute_calls[layer] += 1
                figures.recompute[layer] += call_fwd[call_id]
            else:
                figures.calls[layer] += 1
                figures.fwd[layer] += call_fwd[call_id]
            if call_id in call_bwd:
                figures.bwd[layer] += call_bwd[call_id]
                figures.bwd_calls[layer] += 1
        # the checks' values back in record order (the copy groups them by device), so that
        # the extremes statistics get a layer's calls in call order: act index -> abs max
        lows, highs = packet.batch.get("act_min"), packet.batch.get("act_max")
        position_of = [0] * len(packet.act_order)
        for position, i in enumerate(packet.act_order):
            position_of[i] = position
        act_max: dict[int, float] = {}
        for i, position in enumerate(position_of):
            act = rec.act[i]
            act_max[i] = m = _nanmax([-lows[position], highs[position]])
            if act.call < 0:
                continue  # an input's check, not a layer output
            layer = rec.calls[act.call].layer
            if layer >= n:
                continue
            if not math.isfinite(m):
                figures.nonfinite_outputs.add(layer)
            figures.extremes[layer].append((lows[position], highs[position]))
        figures.checked = bool(rec.act)
        # a replay's layers whose own weights were non-finite (replay.own_weights_nonfinite)
        weights_bad = {i for i, v in enumerate(packet.batch.get("weights_bad")) if v}
        figures.finding = forward_roles(
            rec, self._call_names, len(self.names), act_max, bwd_start, weights_bad
        )
        return figures

    def _add_sampled_step(self, packet: Packet, figures: StepFigures) -> None:
        """A sampled step's times go into the totals; its figures become the last ones."""
        n = len(self.names)
        squares = [0.0] * n
        for part in range(packet.grad_parts):
            for i, v in enumerate(packet.batch.get(("grad_sq", part))):
                squares[i] += v
        for i in range(len(self._call_names)):
            if i >= n and figures.calls[i] and not self.fwd_calls_total[i]:
                self.region_rows.append(i)  # a compiled region's first timed call
            self.fwd_total[i] += figures.fwd[i]
            self.fwd_calls_total[i] += figures.calls[i]
            self.bwd_total[i] += figures.bwd[i]
            self.bwd_calls_total[i] += figures.bwd_calls[i]
            self.recompute_total[i] += figures.recompute[i]
            self.recompute_calls_total[i] += figures.recompute_calls[i]
        self.recent_fwd.add(figures.fwd, figures.calls)
        self.recent_bwd.add(figures.bwd, figures.bwd_calls)
        self._last = {
            "calls": figures.calls,
            "fwd": figures.fwd,
            "recompute": figures.recompute,
            "bwd": figures.bwd,
            "grad": [math.sqrt(squares[i]) if i in packet.has_grad else None for i in range(n)],
        }
        measured = self._fold_statistics(packet, figures)
        if packet.has_grad:
            self.grad_norm = math.sqrt(sum(squares[i] for i in packet.has_grad))
            self._flag_gradients(squares, packet.has_grad)
        if self.efficiency is not None:
            if packet.efficiency is not None:
                self.efficiency.fold(packet, figures.fwd, figures.bwd)
            self.efficiency.note_updates(measured, self._norm_rows())
            if measured:
                self.spikes.observe_update_ratios(packet.step, self.efficiency.step_ratios)
        if self.device_phases is not None:
            self.device_phases.add(figures.device_phases)
        loss = self.loss_of(packet)
        if loss is not None:
            self.loss = loss
        self.sampled_steps += 1
        self.sampled_step_seconds += packet.seconds or 0.0
        self.last_sampled_step = packet.step

    def series_of(self, packet: Packet) -> list[StepValue]:
        """The every-step values `packet` carries (step/series.py decode), decoded once per
        packet: `fold` reads them first, the history (History.observe) after it."""
        if self._series[0] is not packet:
            values = []
            if packet.series is not None:
                blocks = [
                    packet.batch.get(("series", k)) for k in range(len(packet.series.devices))
                ]
                values = decode(packet.series, blocks, packet.step)
            self._series = (packet, values)
        return self._series[1]

    def _fold_statistics(
        self, packet: Packet, figures: StepFigures
    ) -> dict[int, tuple[float, ...]]:
        """The per-layer statistics of a sampled step: of outputs and of their extremes, each
        layer's calls folded (a step without activation statistics, activation_interval_s,
        keeps the last ones, so the gauges do not blink out between them); of parameters,
        the values taken at the step's end."""
        if figures.checked:  # (every row of outputs anew: one that gave nothing has none)
            for k, reach in self._extremes_reach.items():
                self.statistic_values[k] = self._folded(
                    k, ((i, calls) for i, calls in enumerate(figures.extremes) if i in reach)
                )
            self._fold_source(OUTPUT, packet, "stat", packet.stat_parts, packet.stat_order)
        # every sampled step takes the parameter statistics (StepEvents' pack): none in the
        # packet means each failed, and its rows go (no gauge keeps an earlier step's value)
        if self._has_parameter_statistics:
            self._fold_source(
                PARAMETERS, packet, "param_stat", packet.param_stat_parts, packet.param_stat_order
            )
        return self._fold_updates(packet)

    def _norm_rows(self) -> tuple[list[float | None], list[float | None], list[float | None]]:
        """The weight norm, update norm and update ratio statistics' rows (LayerEfficiency)."""
        none: list[float | None] = [None] * len(self.names)
        weight, update, ratio = (
            self.statistic_values[k] if k is not None else none for k in self._norms
        )
        return weight, update, ratio

    def _fold_updates(self, packet: Packet) -> dict[int, tuple[float, ...]]:
        """The statistics of source "update" (step/update_statistics.py) of a step whose
        update was measured: each one's sums added up over devices, and each valued layer's
        folded into its row; the other layers keep their last values (layers take turns).
        Returns the update ratio's (update², weight²) of each layer measured."""
        measured: dict[int, tuple[float, ...]] = {}
        ratio = self._norms[2]
        added: dict[tuple[int, ...], list[float]] = {}  # (the weight squares serve three)
        for k, values, layers in packet.layer_sums_order:
            if k >= len(self._sources) or self._sources[k] != UPDATE:
                continue  # (an aggregator of no such statistic: one a test builds)
            sums = []
            for js in values:
                if js not in added:
                    parts = (packet.batch.get(("layer_sums", j)) for j in js)
                    added[js] = [sum(column) for column in zip(*parts)]
                sums.append(added[js])
            row, statistic = self.statistic_values[k], self.statistics[k]
            for i in layers:
                if i >= len(row) or any(i >= len(s) for s in sums):
                    continue  # (a row beyond the table, or sums made without a part)
                call = tuple(s[i] for s in sums)
                if k == ratio:
                    measured[i] = call
                try:
                    row[i] = fold_calls(statistic, [call])
                except Exception as exc:
                    row[i] = None
                    if self._report is not None:
                        self._report(f"layer statistic {statistic.name}", exc)
        return measured

    def _fold_source(
        self,
        source: str,
        packet: Packet,
        key: str,
        parts: int,
        order: list[tuple[int, int, tuple[float | int, ...]]],
    ) -> None:
        """The rows of the statistics of `source`, replaced by this packet's values, each
        layer's calls folded by its statistic in call order (a statistic that failed on this
        step, or whose fold raised: no value, no gauge)."""
        sent = [v for k in range(parts) for v in packet.batch.get((key, k))]
        # (an int is an index into what was sent, a float a host number: _add_statistics)
        resolved = (
            (k, where, tuple(sent[v] if type(v) is int else v for v in spec))
            for k, where, spec in order
        )
        n = len(self.names)
        calls: dict[int, dict[int, list[tuple[float, ...]]]] = {
            k: {} for k, of in enumerate(self._sources) if of == source
        }
        for k, where, values in resolved:
            # an output's value comes with its call, a parameter statistic's with its layer
            layer = packet.record.calls[where].layer if source == OUTPUT else where  # type: ignore[union-attr]
            # (container modules are hooked by the replay only; an aggregator of no such
            # statistic, one a test builds for other figures, leaves it out)
            if layer < n and k in calls:
                calls[k].setdefault(layer, []).append(values)
        for k, by_layer in calls.items():
            self.statistic_values[k] = self._folded(k, by_layer.items())

    def _folded(
        self, k: int, calls: Iterable[tuple[int, list[tuple[float, ...]]]]
    ) -> list[float | None]:
        """Statistic k's row: each layer's calls folded (a fold that raised: reported, no
        value for that layer)."""
        row: list[float | None] = [None] * len(self.names)
        statistic = self.statistics[k]
        for layer, layer_calls in calls:
            if not layer_calls:
                continue
            try:
                row[layer] = fold_calls(statistic, layer_calls)
            except Exception as exc:
                if self._report is not None:
                    self._report(f"layer statistic {statistic.name}", exc)
        return row

    def _statistic(self, k: int | None, i: int) -> float | None:
        """Statistic k's value for row i (None for a compiled region's row, or no such k)."""
        return self.statistic_values[k][i] if k is not None and i < len(self.names) else None

    @property
    def first_nonfinite_step(self) -> int | None:
        """The step of the run's first NaN/Inf as the counters say, once known."""
        event = self._attribution.event
        return None if event is None else event.step

    @staticmethod
    def loss_of(packet: Packet) -> float | None:
        """The loss a packet carries (in its batch, or as a Python number); the history
        (history.py) reads it the same way."""
        return packet.batch.get("loss")[0] if packet.loss_in_batch else packet.loss

    @property
    def last_step_figures(self) -> dict[str, list[Any]]:
        """The last sampled step's per-layer lists ("fwd", "bwd", "grad", ...; {} before one)."""
        return self._last

    def _judge_spike_replay(self, comparison: SpikeComparison, flags: list[float]) -> None:
        """A spike's replay, or a measured step's update run again (integrity/
        update_replay.py: judged as an update ratio jump's verdict when one began on its
        step, which its sampled packet, come before, has said by now)."""
        replays = self.spike_replays
        assert replays is not None
        if comparison.update_from is None:
            replays.judge(comparison, flags)
        else:
            # (not the last jump's step alone: a comparison decided steps later, once its
            # values reached the host, may come after a later jump's packet)
            replays.judge_update(
                comparison, flags, self.spikes.began_at(UPDATE_RATIO_JUMP, comparison.step)
            )
        self.spikes.note_verdicts(dict(replays.verdicts), dict(replays.update_verdicts))

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

    def _resolve_times(
        self, rec: StepRecord, timer: Timer
    ) -> tuple[list[float], dict[int, float], dict[int, float], Callable[[Any], float]]:
        """Per forward call: exclusive forward seconds; per call with a backward: exclusive
        backward seconds and backward start (seconds from rec.ref); and the seconds from
        rec.ref of any token of the record."""

        # every token resolved at once: one wait for the device, not one per event; the GIL
        # is released between the passes below too (each is ~0.2 ms of Python for 500 calls
        # on a 2-core CPU), so the training thread never waits ~1 ms or more for it
        at = timer.resolve(rec.ref, rec.tokens()).__getitem__
        pause = getattr(timer, "yield_gil", _no_pause)

        ncalls = len(rec.calls)
        span = [0.0] * ncalls
        outer = [0.0] * ncalls
        for c, call in enumerate(rec.calls):
            if call.end is not None and call.start is not None:
                span[c] = max(at(call.end) - at(call.start), 0.0)
                if call.outer_end is not None:
                    outer[c] = max(at(call.outer_end) - at(call.outer_start), 0.0)
                else:
                    outer[c] = span[c]

        pause()
        start: dict[int, float] = {}
        end_of: dict[int, float] = {}
        for roles, tok in rec.grad_ready:
            t = at(tok)
            for role in roles:
                c = role >> 1
                if role & 1:  # the gradient reached c's output: c's backward starts
                    start[c] = min(start.get(c, math.inf), t)
                else:  # c's input gradient is produced: c's backward ends
                    end_of[c] = max(end_of.get(c, -math.inf), t)
        param_end: dict[int, float] = {}
        for layer, tok in rec.param_done:
            param_end[layer] = max(param_end.get(layer, -math.inf), at(tok))
        pause()
        bspan: dict[int, float] = {}
        for c, s in start.items():
            if c >= ncalls:
                continue
            e = end_of.get(c, param_end.get(rec.calls[c].layer))
            if e is not None and e >= s:
                bspan[c] = e - s

        # exclusive times: a parent call (a module that owns parameters and has children)
        # counts neither its instrumented children's time nor our hook work around them
        pause()
        fwd_excl = list(span)
        bwd_excl = dict(bspan)
        for c in range(ncalls):
            parent = rec.calls[c].parent
            if parent < 0:
                continue
            fwd_excl[parent] -= outer[c]
            if parent in bwd_excl and c in bspan:
                bwd_excl[parent] -= bspan[c]
        fwd_excl = [max(v, 0.0) for v in fwd_excl]
        bwd_excl = {c: max(v, 0.0) for c, v in bwd_excl.items()}
        return fwd_excl, bwd_excl, start, at

    # ---- snapshots ----

    def _rebuild_layers(self) -> None:
        n = len(self.names)
        layers = {self.names[i]: self._row_stats(i) for i in range(n)}
        for i in self.region_rows:
            # a compiled region (a block compiled on its own): one call, its own layers inside
            # its graph untimed; no gradients or activations of its own
            layers[self._call_names[i]] = self._row_stats(i)
        self._layers = MappingProxyType(layers)
        self._exported, self._timed = self._select_exported()

    def _row_stats(self, i: int) -> LayerStats:
        last = self._last
        layer = i < len(self.names)  # else a compiled region's row
        return LayerStats(
            name=self._call_names[i],
            module=self._row_types[i],
            calls=last["calls"][i] if last else 0,
            forward_seconds=last["fwd"][i] if last else 0.0,
            backward_seconds=last["bwd"][i] if last else 0.0,
            grad_norm=last["grad"][i] if last and layer else None,
            activation_zero_ratio=self._statistic(self._zero_ratio, i),
            activation_abs_max=self._statistic(self._abs_max, i),
            forward_seconds_total=self.fwd_total[i],
            forward_calls_total=self.fwd_calls_total[i],
            backward_seconds_total=self.bwd_total[i],
            backward_calls_total=self.bwd_calls_total[i],
            forward_seconds_per_call_median=self.recent_fwd.median(i),
            backward_seconds_per_call_median=self.recent_bwd.median(i),
            recompute_seconds=last["recompute"][i] if last else 0.0,
            recompute_seconds_total=self.recompute_total[i],
            recompute_calls_total=self.recompute_calls_total[i],
            nonfinite=MappingProxyType(self._layer_nonfinite(i)),
            gradient_flags=MappingProxyType(
                {k: self.flagged[k][i] if layer else 0 for k in FLAG_KINDS}
            ),
        )

    def _select_exported(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The layers on the page, as (detailed, timed alone): all of them, detailed, within
        both budgets (max_layers layers, max_series series, counted as the exporter writes
        them: snapshot.layer_series); beyond, every layer that went non-finite first (in
        layer order: the earliest is the producer), then the layers with the most
        forward+backward time, while they fit. With `detailed` set, the layers whose gradients
        were flagged (vanishing, exploding) join the non-finite ones, only `detailed` of the
        slowest are detailed, and the rest of the layers go on with their time alone
        (snapshot.timing_series: what the straggler rule reads), slowest first, while the
        series budget allows (max_layers bounds the detailed ones only). The rows of
        compiled regions (a few blocks, each standing for its layers) are not layers for
        max_layers: they go on the page first, detailed, while the series fit."""
        names = self._call_names
        n = len(self.names)
        cost = self._series_per_layer()
        budget = self.max_series if self.max_series is not None else float("inf")
        keep: list[int] = []
        used = 0
        for i in self.region_rows:  # (each a summary pair or two)
            if used + cost[i] <= budget:
                keep.append(i)
                used += cost[i]
        if self.detailed is None and n <= self.max_layers and used + sum(cost[:n]) <= budget:
            return tuple(names[i] for i in range(n)) + tuple(names[i] for i in keep), ()
        bad = [i for i in range(n) if any(self._layer_nonfinite(i).values())]
        if self.detailed is not None:  # a flagged layer's series are what its alert points to
            nonfinite = set(bad)
            bad += [
                i
                for i in range(n)
                if i not in nonfinite and any(self.flagged[k][i] for k in FLAG_KINDS)
            ]
        bad_set = set(bad)
        by_time = sorted(
            (i for i in range(n) if i not in bad_set),
            key=lambda i: self.fwd_total[i] + self.bwd_total[i],
            reverse=True,
        )
        layers: list[int] = []
        for i in bad:  # a bad layer that does not fit leaves room for a later, smaller one
            if used + cost[i] <= budget:
                layers.append(i)
                used += cost[i]
        room = max(self.max_layers - len(layers), 0)
        detailed_left = room if self.detailed is None else min(self.detailed, room)
        timing = self._timing_series_per_layer() if self.detailed is not None else None
        timed: list[int] = []
        # the top layers by time, down to the first that does not fit; with `detailed`, the
        # timed-alone ones are bounded by the series budget only (max_layers bounds the
        # detailed ones): every layer's time is what the straggler rule compares
        for i in by_time if timing is not None else by_time[:room]:
            if detailed_left and used + cost[i] <= budget:
                layers.append(i)
                used += cost[i]
                detailed_left -= 1
            elif timing is not None and used + timing[i] <= budget:
                detailed_left = 0  # the slower ones are detailed, the rest timed alone
                timed.append(i)
                used += timing[i]
            else:
                break
        return (
            tuple(names[i] for i in sorted(layers + keep)),
            tuple(names[i] for i in sorted(timed)),
        )

    def _timing_series_per_layer(self) -> list[int]:
        """Series each layer writes when on the page with its time alone."""
        return [timing_series(self._layers[name]) for name in self.names]

    def _series_per_layer(self) -> list[int]:
        """Series each row writes (0 for a container that is not a compiled region)."""
        names = self._call_names
        if self.max_series is None:
            return [0] * len(names)
        eff = self.efficiency.stats().layers if self.efficiency is not None else {}
        n = len(self.names)
        stats = [
            sum(1 for values in self.statistic_values if values[i] is not None) for i in range(n)
        ]
        return [
            layer_series(self._layers[name], eff.get(name), stats[i] if i < n else 0)
            if name in self._layers
            else 0
            for i, name in enumerate(names)
        ]

    def _layer_nonfinite(self, i: int) -> dict[str, int]:
        # forward: sampled steps' output checks; backward: the device counters (every step);
        # a compiled region's row has neither (its own layers are checked through the replay)
        if i >= len(self.names):
            return {"forward": 0, "backward": 0}
        return {"forward": self.fwd_nonfinite[i], "backward": self.counters["layer_bad"][i]}

    def _dropped(self) -> DroppedNonFinite | None:
        """The dropped non-finite steps the counters hold (fold_counters), their first one's
        layers named: the first in backward's order is the last in module order."""
        c = self.counters
        steps, first = c["dropped_bad"][0], c["dropped_first"][0]
        if not steps or first < 0:
            return None
        bad = [self.names[i] for i, flag in enumerate(c["dropped_layers"]) if flag]
        return DroppedNonFinite(steps, first, bad[-1] if bad else None, tuple(reversed(bad[:-1])))

    def snapshot(
        self, counters: StepCounters, internal_errors: int, notices: tuple[str, ...] = ()
    ) -> Snapshot:
        if self._dirty:
            self._rebuild_layers()
            self._dirty = False
        steps, buckets, total, last_ts, skipped, persistent_skips = counters.read()
        # a fused optimizer's GradScaler skips on the device: counted there
        device_skipped, device_persistent = self.device_counts.get("scaler_skips", (0, 0))
        skipped += device_skipped
        persistent_skips += device_persistent
        held_back = counters.held_back + self.device_counts.get("held_back", (0, 0))[0]
        phase_bad = self.counters["phase_bad"]
        nonfinite_steps = {p: phase_bad[PHASE_INDEX[p]] for p in PHASES}
        nonfinite_steps["backward"] += persistent_skips  # skipping that never stops
        first = self._attribution.event
        if first is None and persistent_skips:
            first = NonFiniteEvent(GRADSCALER_LAYER, "backward", steps)
        return Snapshot(
            rank=self.rank,
            step=steps,
            sampled_steps=self.sampled_steps,
            sampled_step_seconds=self.sampled_step_seconds,
            last_sampled_step=self.last_sampled_step,
            step_duration_buckets=buckets,
            step_duration_sum=total,
            last_step_timestamp=last_ts,
            loss=self.loss,
            grad_norm=self.grad_norm,
            nonfinite_steps=MappingProxyType(nonfinite_steps),
            skipped_steps=skipped,
            held_back_updates=held_back,
            capsules_written=self._attribution.capsules_written
            + (self.replay.capsules if self.replay is not None else 0)
            + (self.spike_replays.capsules if self.spike_replays is not None else 0),
            internal_errors=internal_errors,
            layers=self._layers,
            exported_layers=self._exported,
            timed_layers=self._timed,
            first_nonfinite=first,
            dropped_nonfinite=self._dropped(),
            gradient_flagged_steps=MappingProxyType(dict(self.flagged_steps)),
            notices=notices,
            efficiency=self.efficiency.stats() if self.efficiency is not None else None,
            device_phase_seconds=self.device_phases.by_phase()
            if self.device_phases is not None
            else None,
            device_phase_steps=self.device_phases.steps if self.device_phases is not None else 0,
            layer_statistics=self._statistics_view(),
            spikes=self.spikes.counts(),
            parameter_fingerprint=self.fingerprint,
            parameter_changes=self.parameter_changes,
            parameter_change=self.parameter_change,
            parameter_watches=MappingProxyType(dict(self.parameter_watches)),
            replay_checks=self.replay.view() if self.replay is not None else MappingProxyType({}),
            spike_replays=(
                self.spike_replays.view()
                if self.spike_replays is not None
                else MappingProxyType({})
            ),
            replay_mismatch=self.replay.last_mismatch if self.replay is not None else None,
            spike_mismatch=(
                self.spike_replays.last_mismatch if self.spike_replays is not None else None
            ),
        )

    def _statistics_view(self) -> Mapping[str, LayerStatisticValues]:
        if not self.statistics:
            return MappingProxyType({})
        index = {name: i for i, name in enumerate(self.names)}
        return MappingProxyType(
            {
                name: LayerStatisticValues(
                    help,
                    MappingProxyType(
                        {
                            layer: value
                            for layer in self._exported
                            if layer in index and (value := values[index[layer]]) is not None
                        }
                    ),
                )
                for (name, help), values in zip(
                    ((s.name, s.help) for s in self.statistics), self.statistic_values
                )
            }
        )


def _no_pause() -> None:
    pass  # a Timer without yield_gil (one a test supplies): the passes run back to back
