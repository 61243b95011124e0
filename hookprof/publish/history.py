"""The run's history for the report: a small, bounded record of the sampled steps.

Fed on the publisher thread from what it has just folded (never from the training thread):
one point per sampled step with the step number, wall time, step time, loss, global
gradient norm and the cumulative count of non-finite steps, and per layer the step's
forward and backward seconds and gradient norm; plus the NaN timeline.

Memory is fixed however long the run:
- at most `max_points` points. When full, neighbours are merged pairwise (the history keeps
  half as many points, each covering twice as many sampled steps) and from then on each new
  point covers that many sampled steps before the next one opens. A run of a million steps
  keeps the shape of the whole run at 1/2048th the resolution, never a cut-off window.
- per-layer series for at most `layer_slots` layers: all of them when the model has no more,
  else the layers that went non-finite and then the top ones by total time. A layer that
  takes a slot later has no values before it did (a slot handed over is cleared). A compiled
  region (a block compiled on its own, timed as one row: the rows after the layers) is
  followed like a layer once it has been timed, in a slot of its own while slots are left.
- at most `max_events` non-finite events: the first half kept, then the latest half.

How merged points combine: step and wall time are the later point's; step time is the mean
weighted by the steps each point covers; loss and per-layer times the mean; gradient norms
(global and per layer) the maximum, so a spike survives any amount of merging. A value that
was not finite is stored as +inf and wins every merge: a NaN never averages away. NaN in
storage means "no value" (no loss given, a layer without a gradient or not yet tracked).
"""

from __future__ import annotations

import heapq
import math
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hookprof.publish.every_step import EveryStep, stored

__all__ = ["History", "stored"]

if TYPE_CHECKING:
    from hookprof.publish.aggregate import Aggregator
    from hookprof.step.record import Packet, StepCounters

MAX_POINTS = 512
LAYER_SLOTS = 64
MAX_EVENTS = 64
RERANK_POINTS = 8  # which layers the per-layer series follow is decided again this often

_MISSING = math.nan
# the columns of a point, and how two neighbours merge
COLUMNS = {
    "step": "last",
    "wall_time": "last",
    "step_seconds": "mean_steps",
    "loss": "mean",
    "grad_norm": "max",
    "nonfinite_steps": "last",
    "samples": "sum",
    "steps": "sum",  # sampled steps / steps a point covers (the weights)
}
LAYER_COLUMNS = {"forward_seconds": "mean", "backward_seconds": "mean", "grad_norm": "max"}


def _merge(rule: str, a: float, b: float, wa: float, wb: float) -> float:
    """Two neighbours' values of one column; wa, wb their weights for a mean."""
    if rule == "last":
        return b if b == b else a
    if rule == "sum":
        return a + b
    if a != a:  # missing: the other one stands
        return b
    if b != b:
        return a
    if math.isinf(a) or math.isinf(b):
        return math.inf
    if rule == "max":
        return max(a, b)
    total = wa + wb
    return (a * wa + b * wb) / total if total > 0 else (a + b) / 2


class History:
    """Owned by the publisher thread, which calls `observe`; anyone may call `view`."""

    def __init__(
        self,
        names: list[str],
        *,
        max_points: int = MAX_POINTS,
        layer_slots: int = LAYER_SLOTS,
        max_events: int = MAX_EVENTS,
        container_names: Sequence[str] = (),
    ):
        if max_points < 2 or max_points % 2:
            raise ValueError(f"max_points must be an even number >= 2, got {max_points}")
        # rows: the layers, then the container modules (timed when one is a compiled region)
        self.names = list(names) + list(container_names)
        self._n_layers = len(names)
        self._max_slots = layer_slots
        self.max_points = max_points
        self.layer_slots = min(layer_slots, len(names))
        self.max_events = max_events
        self.stride = 1  # sampled steps per point, doubled at each halving
        self._lock = threading.Lock()
        self._cols = {name: array("d") for name in COLUMNS}
        self._layer_cols = {
            name: [array("d") for _ in range(self.layer_slots)] for name in LAYER_COLUMNS
        }
        # slot -> layer index; with no more layers than slots, slot k is layer k for good
        self._slot_layer: list[int] = list(range(self.layer_slots))
        self._fixed_slots = self.layer_slots == len(names)
        self._events_first: list[dict[str, Any]] = []
        self._events_last: deque[dict[str, Any]] = deque(
            maxlen=max(max_events - max_events // 2, 1)
        )
        self.events_dropped = 0
        self._seen_steps = 0  # StepCounters' steps and sum at the last point
        self._seen_sum = 0.0
        self._seen_bad = 0  # non-finite steps already in an event
        self._seen_layer_bad: list[int] = [0] * len(names)
        self._regions_seen = 0  # timed compiled-region rows when slots were last looked at
        self._opened = 0  # points opened so far
        self._ranked_bad = 0  # non-finite steps when the slots were last assigned
        # every step's loss and gradient norm, not only the sampled steps' (publish/every_step.py)
        self.every_step = EveryStep()

    # ---------------- feeding (publisher thread) ----------------

    def observe(self, packet: Packet, aggregator: Aggregator, counters: StepCounters) -> None:
        """After `aggregator` folded `packet`: a point for a sampled step, an event when the
        non-finite counts went up."""
        steps, total, wall = counters.latest()
        if packet.steps_at_end is not None:  # as the step ended, not as the fold finds them
            steps, total = packet.steps_at_end
        bad = int(sum(aggregator.counters["phase_bad"]))
        loss = aggregator.loss_of(packet)
        if packet.series is not None:  # (decoded once, by the aggregator's fold)
            self.every_step.observe(aggregator.series_of(packet), aggregator.first_nonfinite_step)
        with self._lock:
            if packet.sampled:
                self._add_point(packet.step, steps, total, wall, aggregator, bad, loss)
            elif loss is not None and packet.record is None:
                self._late_loss(packet.step, loss)
            if bad > self._seen_bad:
                self._add_event(packet.step, wall, aggregator, bad)

    def _add_point(
        self,
        step: int,
        steps: int,
        total: float,
        wall: float | None,
        aggregator: Aggregator,
        bad: int,
        loss: float | None,
    ) -> None:
        covered = steps - self._seen_steps
        step_seconds = (total - self._seen_sum) / covered if covered > 0 else _MISSING
        self._seen_steps, self._seen_sum = steps, total
        last = aggregator.last_step_figures
        point = {
            "step": float(step),
            "wall_time": stored(wall),
            "step_seconds": step_seconds,
            "loss": stored(loss),
            "grad_norm": stored(aggregator.grad_norm),
            "nonfinite_steps": float(bad),
            "samples": 1.0,
            "steps": float(max(covered, 0)),
        }
        n = len(self._cols["step"])
        opening = not n or self._cols["samples"][n - 1] >= self.stride
        if opening:
            self._opened += 1
        # ranking 10,000 layers takes ~10 ms of the publisher thread: done every RERANK_POINTS
        # points, at a point's opening when more steps went non-finite, and at once the first time
        regions = aggregator.region_rows
        new_regions = len(regions) != self._regions_seen
        if new_regions:
            self._regions_seen = len(regions)
            self._add_region_slots(regions)
        if (
            (opening and (self._opened % RERANK_POINTS == 1 or bad != self._ranked_bad))
            or (bad and not self._ranked_bad)
            or (new_regions and not self._fixed_slots)
        ):
            self._ranked_bad = bad
            self._assign_slots(aggregator)
        per_layer = {
            "forward_seconds": [last["fwd"][i] if last else _MISSING for i in self._slot_layer],
            "backward_seconds": [last["bwd"][i] if last else _MISSING for i in self._slot_layer],
            "grad_norm": [
                stored(last["grad"][i]) if last and i < self._n_layers else _MISSING
                for i in self._slot_layer
            ],
        }
        if not opening:
            self._merge_into_last(point, per_layer)  # the open point takes this one in
            return
        if n == self.max_points:
            self._halve()
        for name, value in point.items():
            self._cols[name].append(value)
        for name, values in per_layer.items():
            for k, value in enumerate(values):
                self._layer_cols[name][k].append(value)

    def _late_loss(self, step: int, loss: float) -> None:
        """prof.step(loss) after an optimizer step ended the sampled step (the loss came on
        its own): it is that point's loss when the point has none."""
        n = len(self._cols["step"])
        if (
            n
            and self._cols["step"][n - 1] == step
            and self._cols["loss"][n - 1] != self._cols["loss"][n - 1]
        ):
            self._cols["loss"][n - 1] = stored(loss)

    def _merge_into_last(self, point: dict[str, float], per_layer: dict[str, list[float]]) -> None:
        i = len(self._cols["step"]) - 1
        wa, wb = self._cols["samples"][i], point["samples"]
        sa, sb = self._cols["steps"][i], point["steps"]
        for name, rule in COLUMNS.items():
            col = self._cols[name]
            weights = (sa, sb) if rule == "mean_steps" else (wa, wb)
            col[i] = _merge(rule.replace("_steps", ""), col[i], point[name], *weights)
        for name, rule in LAYER_COLUMNS.items():
            for k, value in enumerate(per_layer[name]):
                col = self._layer_cols[name][k]
                col[i] = _merge(rule, col[i], value, wa, wb)

    def _halve(self) -> None:
        """Merge neighbours pairwise: max_points points become max_points / 2."""
        samples, steps = self._cols["samples"], self._cols["steps"]
        pairs = range(0, len(samples) - 1, 2)

        def halved(col: array, rule: str) -> array:
            weights = steps if rule == "mean_steps" else samples
            rule = rule.replace("_steps", "")
            return array(
                "d", (_merge(rule, col[j], col[j + 1], weights[j], weights[j + 1]) for j in pairs)
            )

        for name, slots in self._layer_cols.items():
            self._layer_cols[name] = [halved(col, LAYER_COLUMNS[name]) for col in slots]
        # the weight columns last: the others' merges read them
        for name in sorted(COLUMNS, key=lambda c: c in ("samples", "steps")):
            self._cols[name] = halved(self._cols[name], COLUMNS[name])
        self.stride *= 2

    def _add_region_slots(self, regions: list[int]) -> None:
        """Compiled regions timed for the first time: a slot each while fewer than the
        limit are in use (no values before now), else they compete for the slots by time."""
        held = set(self._slot_layer)
        points = len(self._cols["step"])
        for i in regions:
            if i in held:
                continue
            if self.layer_slots >= self._max_slots:
                self._fixed_slots = False  # ranked from now on, regions among the layers
                continue
            self._slot_layer.append(i)
            self.layer_slots += 1
            for name in LAYER_COLUMNS:
                self._layer_cols[name].append(array("d", [_MISSING] * points))

    def _assign_slots(self, aggregator: Aggregator) -> None:
        """Which layers the per-layer series follow: every layer when they fit, else the
        non-finite ones first, then the top by total time. A layer keeps its slot while it
        stays among those; a newcomer takes a free slot or the least busy one left out."""
        if self._fixed_slots:
            return
        n = self._n_layers
        layer_bad = aggregator.counters["layer_bad"]
        rows = len(self.names)
        time_of = [aggregator.fwd_total[i] + aggregator.bwd_total[i] for i in range(rows)]
        bad = [i for i in range(n) if layer_bad[i] or aggregator.fwd_nonfinite[i]]
        room = self.layer_slots - len(bad)
        if room <= 0:  # once a NaN has spread, the non-finite layers alone fill the slots
            wanted = bad[: self.layer_slots]
        else:  # (one set, not one per layer: this runs on the publisher thread, 10k layers)
            bad_set = set(bad)
            candidates = [*range(n), *aggregator.region_rows]
            wanted = bad + heapq.nlargest(
                room, (i for i in candidates if i not in bad_set), key=time_of.__getitem__
            )
        held = set(self._slot_layer)
        wanted_set = set(wanted)
        leaving = sorted(
            (k for k, i in enumerate(self._slot_layer) if i not in wanted_set),
            key=lambda k: time_of[self._slot_layer[k]],
        )
        for i in wanted:
            if i in held or not leaving:
                continue
            k = leaving.pop(0)
            self._slot_layer[k] = i
            for cols in self._layer_cols.values():  # its past belongs to another layer
                col = cols[k]
                for j in range(len(col)):
                    col[j] = _MISSING

    def _add_event(self, step: int, wall: float | None, aggregator: Aggregator, bad: int) -> None:
        layer_bad = aggregator.counters["layer_bad"]
        newly = [
            self.names[i]
            for i in range(self._n_layers)
            if layer_bad[i] + aggregator.fwd_nonfinite[i] > self._seen_layer_bad[i]
        ]
        self._seen_layer_bad = [
            layer_bad[i] + aggregator.fwd_nonfinite[i] for i in range(self._n_layers)
        ]
        event = {
            "step": step,
            "wall_time": wall,
            "new_nonfinite_steps": bad - self._seen_bad,
            "nonfinite_steps": bad,
            "layers": newly[:8],
            "more_layers": max(len(newly) - 8, 0),
        }
        self._seen_bad = bad
        if len(self._events_first) < self.max_events // 2:
            self._events_first.append(event)
        else:
            if len(self._events_last) == self._events_last.maxlen:
                self.events_dropped += 1
            self._events_last.append(event)

    # ---------------- reading (any thread) ----------------

    def view(self) -> dict[str, Any]:
        """A copy in plain Python: None for no value, math.inf for a non-finite one."""

        def plain(col: array) -> list[float | None]:
            return [None if v != v else v for v in col]

        with self._lock:
            points = {name: plain(col) for name, col in self._cols.items()}
            layers = [
                {
                    "name": self.names[i],
                    **{name: plain(self._layer_cols[name][k]) for name in LAYER_COLUMNS},
                }
                for k, i in enumerate(self._slot_layer)
            ]
            events = [dict(e) for e in (*self._events_first, *self._events_last)]
            return {
                "stride": self.stride,
                "max_points": self.max_points,
                "points": points,
                "layers": layers,
                "events": events,
                "events_dropped": self.events_dropped,
                "every_step": self.every_step.view(),
            }

    def nbytes(self) -> int:
        """Bytes held by the series (the part that would grow with the run if unbounded)."""
        with self._lock:
            arrays = list(self._cols.values()) + [
                c for cols in self._layer_cols.values() for c in cols
            ]
            return sum(a.itemsize * a.buffer_info()[1] for a in arrays)
