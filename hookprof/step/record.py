"""One step's record and its packing for the publisher.

What the hooks of a sampled step wrote (a StepRecord of named Calls and Activations), the
per-step counters, and the packing of one step's device scalars into the Packet the
publisher folds.

The training thread writes records and counters; `pack_step` gathers a finished step's
scalars (gradient squares, activation reductions, non-finite counters, the loss) into one
ScalarBatch and starts its single device-to-host copy.
"""

from __future__ import annotations

import bisect
import math
import numbers
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hookprof.device import transfer
from hookprof.device.transfer import HostBatch, ScalarBatch
from hookprof.snapshot import STEP_DURATION_BUCKETS
from hookprof.step.gradients import Reading
from hookprof.step.series import SeriesDrain


class Call:
    """One forward call of a layer on a sampled step. Tokens are the timer's marks; the
    "outer" ones include hookprof's own work around the call, which a parent call must not
    count as its own time (taken only for calls with an instrumented parent)."""

    __slots__ = ("layer", "parent", "outer_start", "start", "end", "outer_end")

    def __init__(self, layer: int, parent: int, outer_start: Any = None):
        self.layer = layer  # index in the LayerTable
        self.parent = parent  # the enclosing instrumented call's id, or -1
        self.outer_start = outer_start
        self.start: Any = None
        self.end: Any = None
        self.outer_end: Any = None

    def tokens(self) -> Iterator[Any]:
        return (
            t for t in (self.outer_start, self.start, self.end, self.outer_end) if t is not None
        )


ROOT_INPUT = -2  # Activation.call of the root module's inputs


class Activation(NamedTuple):
    """Device-side reductions of one floating tensor a call produced (or received)."""

    call: int  # the call whose output it is; -1 for an input that was no layer's output,
    # ROOT_INPUT for an input of the root module
    low: torch.Tensor  # min, 0-d, on the device
    high: torch.Tensor  # max


class StepRecord:
    """What the hooks of one sampled step wrote. Appends only: list.append is atomic, and
    backward hooks may run on autograd worker threads."""

    __slots__ = (
        "ref",
        "calls",
        "grad_ready",
        "param_done",
        "act",
        "param_hooked",
        "param_handles",
        "pending_marks",
        "out_stats",
        "inputs",
        "recompute",
        "ended",
        "phase_marks",
        "stats",
        "untimed",
        "fingerprints",
    )

    def __init__(self, ref: Any):
        self.ref = ref  # timer token taken when the step began
        self.calls: list[Call] = []  # one per forward call; a call's id is its position
        # (roles, token): a gradient was ready at token; each role is `call id << 1 | is_output`
        # (an int, not a tuple: one allocation less per layer call): for an output the
        # call's backward starts there, for an input the call's backward ends
        self.grad_ready: list[tuple[list[int], Any]] = []
        self.param_done: list[
            tuple[int, Any]
        ] = []  # (layer, token): a parameter's grad accumulated
        self.act: list[Activation] = []
        self.param_hooked: set[int] = set()
        self.param_handles: list[Any] = []
        # autograd node -> its roles (as in grad_ready), not yet hooked: during the root
        # module's training forward they gather until it returns, so one pre-hook per node
        # serves every role (one layer's output is the next one's input); elsewhere each call
        # hooks its own. Keyed by the node itself, which it keeps alive until then
        self.pending_marks: dict[Any, list[int]] = {}
        # id(tensor) -> (weakref, version, index in act) of outputs already reduced, so a
        # layer's input that is another layer's output is not reduced twice
        self.out_stats: dict[int, tuple[Any, int, int]] = {}
        self.inputs: list[tuple[int, int]] = []  # (call, index in act) of each floating input
        # calls made while backward runs: activation checkpointing recomputing a forward
        self.recompute: set[int] = set()
        self.ended: list[int] = []  # call ids as they ended (with output checks on): inner first
        # (phase entered, token) at each step-phase boundary, with a device timer only
        # (device_phases.PhaseMarks); the last is the step's end
        self.phase_marks: list[tuple[int, Any]] = []
        # (statistic, call, its values: 0-d tensors on the device and host numbers): the
        # per-layer statistics of outputs, hookprof's and the user's (step/statistics.py)
        self.stats: list[tuple[int, int, tuple[Any, ...]]] = []
        # calls whose times are not the step's: an eager no_grad re-run's (nonfinite/checks.py),
        # a compiled region's call during which Dynamo compiled (a first call, a recompile)
        self.untimed: set[int] = set()
        # (call, 0-d int64 on the device): each instrumented output's bits summed
        # (tensors.output_checksum), on a replay check's step and in its replay (hookprof/integrity/)
        self.fingerprints: list[tuple[int, torch.Tensor]] = []

    def absorb_rerun(self, other: StepRecord) -> None:
        """A re-run's own record joins this step's: its calls after this one's (numbered on,
        their activations, statistics and marks with them), recorded as a re-run. The re-run
        recorded apart, so this step's own parameter hooks and pending marks were never
        touched by it (a later forward of the step still gets its own). A re-run runs under
        no_grad: it leaves no backward marks and recomputes nothing."""
        calls, acts = len(self.calls), len(self.act)
        for call in other.calls:
            if call.parent >= 0:
                call.parent += calls
            self.calls.append(call)
        self.act.extend(a if a.call < 0 else a._replace(call=a.call + calls) for a in other.act)
        self.inputs.extend((c + calls, i + acts) for c, i in other.inputs)
        self.ended.extend(c + calls for c in other.ended)
        self.stats.extend((k, c + calls, v) for k, c, v in other.stats)
        self.untimed.update(range(calls, len(self.calls)))

    def tokens(self) -> Iterator[Any]:
        """Every timer token in the record, so the timer can take pooled events back."""
        yield self.ref
        for call in self.calls:
            yield from call.tokens()
        yield from (t for _, t in self.grad_ready)
        yield from (t for _, t in self.param_done)
        yield from (t for _, t in self.phase_marks)


class StepCounters:
    """Per-step numbers the training thread updates on every step (sampled or not)."""

    def __init__(self, max_skipped_steps: int = 10) -> None:
        self._lock = threading.Lock()  # uncontended: ~0.1 us per step
        self.steps = 0
        self.last_seconds: float | None = None  # the last step's time
        self._counts = [0] * (len(STEP_DURATION_BUCKETS) + 1)
        self._sum = 0.0
        self._last_ts: float | None = None
        self._max_skips = max_skipped_steps
        self.skipped = 0
        self.held_back = 0  # updates held back on the host's word (guard.UpdateGuard)
        self._skips_in_a_row = 0
        self.persistent_skips = 0  # skipped steps beyond max_skipped_steps in a row

    def observe(self, seconds: float, wall_time: float, skipped: bool = False) -> int:
        with self._lock:
            self.steps += 1
            self._counts[bisect.bisect_left(STEP_DURATION_BUCKETS, seconds)] += 1
            self._sum += seconds
            self.last_seconds = seconds  # (the every-step series takes it: step/series.py)
            self._last_ts = wall_time
            if skipped:
                self.skipped += 1
                self._skips_in_a_row += 1
                if self._skips_in_a_row > self._max_skips:
                    self.persistent_skips += 1
            else:
                self._skips_in_a_row = 0
            return self.steps

    def set_held_back(self, held_back: int) -> None:
        """The updates held back on the host's word so far (the guard counts them)."""
        self.held_back = held_back

    def totals(self) -> tuple[int, float]:
        """(steps, their summed duration): what a sampled step's packet carries."""
        with self._lock:
            return self.steps, self._sum

    def latest(self) -> tuple[int, float, float | None]:
        """(steps, their summed duration, wall time of the last one's end): what the history
        reads at each fold, without the histogram read() builds."""
        with self._lock:
            return self.steps, self._sum, self._last_ts

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
class Packet:
    """What the training thread hands the publisher: a sampled step, a replayed forward
    (record, not sampled) or a drain of the non-finite counters alone (neither)."""

    step: int  # 1-based number of the step
    batch: HostBatch  # the step's one device-to-host copy, started (pack_step)
    record: StepRecord | None = None
    sampled: bool = True
    grad_parts: int = 0  # how many per-device gradient vectors the batch holds
    has_grad: frozenset[int] = frozenset()  # layers that had a gradient
    act_order: list[int] = field(default_factory=list)  # record.act index of each value
    counter_parts: int = 0  # how many non-finite counter blocks the batch holds
    dropped_parts: int = (
        0  # the devices' kept values of the first dropped step (Detector.dropped_blocks)
    )
    count_parts: dict[str, int] = field(default_factory=dict)  # other counters: name -> blocks
    loss: float | None = None  # the loss when it was given as a Python number
    loss_in_batch: bool = False
    # the step counters as this packet's step ended (steps, seconds summed): the publisher
    # may fold it a few steps later, when the live counters have moved on
    steps_at_end: tuple[int, float] | None = None
    seconds: float | None = None  # a sampled step's wall time (the layers' times' window)
    efficiency: Any = None  # an efficiency.EfficiencyPart on sampled steps with those figures
    # (statistic, call, its values: an int is the index of a value in the concatenation of
    # the batch's ("stat", 0), ("stat", 1), ... parts, one per device, a float a host
    # number) of each per-layer statistic's reduction, in the order they were taken
    # (_add_statistics; the statistics: step/statistics.py)
    stat_order: list[tuple[int, int, tuple[float | int, ...]]] = field(default_factory=list)
    stat_parts: int = 0
    # the same of the parameter statistics, with ("param_stat", k) stacks and the layer in
    # place of the call: taken at a sampled step's end (step/statistics.py)
    param_stat_order: list[tuple[int, int, tuple[float | int, ...]]] = field(default_factory=list)
    param_stat_parts: int = 0
    # the statistics of source "update" (step/update_statistics.py): per statistic, its
    # index, per value the batch's ("layer_sums", j) parts to add up, and the layers valued
    layer_sums_order: list[tuple[int, tuple[tuple[int, ...], ...], frozenset[int]]] = field(
        default_factory=list
    )
    # the forward of `step` went non-finite and could not be replayed: why (nonfinite/replay.py)
    not_replayed: str | None = None
    replay_moved: int = 0  # a replay's packet: updates applied between its forward and the replay
    capsule: str | None = None  # the incident capsule written for `step` (nonfinite/capsule.py)
    fingerprint_parts: int = 0  # the parameters' fingerprint after `step`'s update, per device
    # the parameters changed between `step`'s forward and its update: per device (how many,
    # the first's position in `changed_names`) (integrity/replicas.py)
    changed_parts: int = 0
    changed_names: Sequence[str] = ()
    replay_check: Any = None  # a replay check's comparison (integrity/replay_check.py)
    replay_parts: int = 0  # its device flags, one stack per device
    # every step's loss and gradient norm since the last drain: the batch's ("series", k)
    # blocks are the rings of `series.devices` (step/series.py)
    series: SeriesDrain | None = None


def real_loss(loss: Any) -> tuple[Any, str | None]:
    """The loss `prof.step(loss)` was given, if it is a real scalar: a tensor of one real
    (not complex) element, or a real number. Returns (loss, None) for those (a number that is
    not a Python one, e.g. numpy's, as a float), else (None, what it is, in words): a tuple
    `(loss, outputs)`, a dict, a list, a complex or many-element tensor is neither checked
    nor exported, and the step goes on like one given no loss. Never raises, never waits for
    a device (a tensor's size and dtype are on the host)."""
    if loss is None:
        return None, None
    try:
        if isinstance(loss, torch.Tensor):
            if loss.numel() == 1 and not loss.is_complex():
                return loss, None
            return None, f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
        if isinstance(loss, numbers.Real):
            return loss, None
        if not isinstance(loss, (numbers.Complex, str, bytes)):
            return float(loss), None  # numpy's one-element arrays and the like
    except Exception:
        pass  # an object whose float() fails: not a loss hookprof can read
    return None, f"a {type(loss).__module__}.{type(loss).__qualname__}".replace("a builtins.", "a ")


def checked_sample_losses(values: Any) -> torch.Tensor:
    """`prof.step(sample_losses=...)` as given, if it is one: a real floating-point tensor with
    a first dimension (the batch's); else a TypeError or ValueError that says what it was.
    Reads nothing from a device."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(
            "prof.step(sample_losses=...) takes a tensor of each sample's loss (e.g. "
            f"F.cross_entropy(logits, y, reduction='none')), not a {type(values).__name__}"
        )
    if not values.is_floating_point() or values.dim() == 0 or values.numel() == 0:
        raise ValueError(
            "prof.step(sample_losses=...) takes a real floating-point tensor with one row per "
            f"sample of the batch; this one has shape {tuple(values.shape)} and dtype "
            f"{values.dtype}"
        )
    return values


def loss_notice(what: str) -> str:
    """The notice for a loss that is not a real scalar (real_loss)."""
    return (
        f"prof.step(loss) was given {what}, not a real scalar: the loss is neither exported "
        "(hookprof_loss) nor checked for NaN/Inf; steps are counted and the gradients and "
        "per-layer checks go on. Pass the scalar loss itself, e.g. prof.step(loss) rather than "
        "prof.step((loss, outputs)), or .real/.mean() of it"
    )


def pack_step(
    step: int,
    record: StepRecord | None,
    counter_blocks: list[torch.Tensor],
    *,
    grad_squares: Reading | None = None,
    loss: Any = None,
    sampled: bool = True,
    counts: dict[str, list[torch.Tensor]] | None = None,
    efficiency: Any = None,
    extra: Sequence[tuple[Any, torch.Tensor]] = (),
    not_replayed: str | None = None,
    replay_moved: int = 0,
    capsule: str | None = None,
    dropped_values: Sequence[torch.Tensor] = (),
    series: tuple[list[list[torch.Tensor]], SeriesDrain] | None = None,
    parameter_stats: Sequence[tuple[int, int, tuple[Any, ...]]] = (),
    layer_sums: Sequence[tuple[int, tuple[Any, ...], frozenset[int]]] = (),
    fingerprint: Sequence[torch.Tensor] = (),
    changes: tuple[Sequence[torch.Tensor], Sequence[str]] | None = None,
    replay_check: tuple[Any, Sequence[torch.Tensor]] | None = None,
) -> Packet:
    """Gather one step's device scalars (per-device gradient squares, the record's activation
    reductions and statistics, the parameter statistics taken at its end, the non-finite
    counter blocks, the loss) and start their one device-to-host
    copy; the returned packet is the publisher's. Also for a replayed forward (`sampled=False`
    with a record) and a drain of the counters alone (neither)."""
    batch = ScalarBatch()
    parts, has_grad = grad_squares or ([], frozenset())
    for k, part in enumerate(parts):
        batch.add(("grad_sq", k), part)
    act_order = _add_activations(batch, record) if record is not None else []
    stat_order, stat_parts = (
        _add_statistics(batch, "stat", record.stats) if record is not None else ([], 0)
    )
    param_stat_order, param_stat_parts = _add_statistics(batch, "param_stat", parameter_stats)
    layer_sums_order = _add_layer_sums(batch, layer_sums)
    for k, block in enumerate(counter_blocks):
        batch.add(("counters", k), block)
    for k, halves in enumerate(fingerprint):  # the parameters' (integrity/replicas.py)
        batch.add(("fingerprint", k), halves)
    changed, changed_names = changes if changes is not None else ((), ())
    for k, counted in enumerate(changed):  # (integrity/replicas.py ReplicaCheck.release)
        batch.add(("changed", k), counted)
    comparison, replay_parts = replay_check if replay_check is not None else (None, ())
    for k, flags in enumerate(replay_parts):  # integrity/replay_check.py
        batch.add(("replay", k), flags)
    for k, block in enumerate(dropped_values):
        batch.add(("dropped", k), block)
    count_parts = {}
    for name, blocks in (counts or {}).items():  # other device counters (guard.SkipCounters)
        for k, block in enumerate(blocks):
            batch.add((name, k), block)
        count_parts[name] = len(blocks)
    for key, values in extra:  # other device scalars (a replay's layers with non-finite weights)
        batch.add(key, values)
    for k, rows in enumerate(series[0] if series is not None else ()):
        for part in rows:  # (cat copies them: the next steps' writes come after)
            batch.add(("series", k), part)
    loss_in_batch, host_loss = False, None
    if isinstance(loss, torch.Tensor) and not transfer.on_host(loss):
        batch.add("loss", loss.detach().reshape(-1)[:1])  # rides the step's one copy
        loss_in_batch = True
    elif loss is not None:  # a number, or a tensor readable without a wait (transfer.on_host)
        host_loss = (
            float(loss.detach().reshape(-1)[0]) if isinstance(loss, torch.Tensor) else float(loss)
        )
    return Packet(
        step=step,
        batch=batch.send(),
        record=record,
        sampled=sampled,
        grad_parts=len(parts),
        has_grad=has_grad,
        act_order=act_order,
        counter_parts=len(counter_blocks),
        dropped_parts=len(dropped_values),
        count_parts=count_parts,
        efficiency=efficiency,
        stat_order=stat_order,
        stat_parts=stat_parts,
        param_stat_order=param_stat_order,
        param_stat_parts=param_stat_parts,
        layer_sums_order=layer_sums_order,
        not_replayed=not_replayed,
        replay_moved=replay_moved,
        capsule=capsule,
        fingerprint_parts=len(fingerprint),
        changed_parts=len(changed),
        changed_names=changed_names,
        replay_check=comparison,
        replay_parts=len(replay_parts),
        series=series[1] if series is not None else None,
        loss=host_loss,
        loss_in_batch=loss_in_batch,
    )


def _add_layer_sums(
    batch: ScalarBatch, taken: Sequence[tuple[int, tuple[Any, ...], frozenset[int]]]
) -> list[tuple[int, tuple[tuple[int, ...], ...], frozenset[int]]]:
    """Put the update statistics' sums per layer (UpdateStatistics.take: (statistic, its
    LayerSums, the layers valued)) into the batch, each LayerSums once however many
    statistics returned it (the weight squares: three), its per-device parts as
    ("layer_sums", j). Returns each entry with the js of each of its values."""
    placed: dict[int, tuple[int, ...]] = {}  # id(LayerSums) -> its parts' js
    order = []
    added = 0
    for statistic, sums, layers in taken:
        values = []
        for one in sums:
            js = placed.get(id(one))
            if js is None:
                js = placed[id(one)] = tuple(range(added, added + len(one.parts)))
                added += len(one.parts)
                for j, part in zip(js, one.parts):
                    batch.add(("layer_sums", j), part)
            values.append(js)
        order.append((statistic, tuple(values), layers))
    return order


def _add_statistics(
    batch: ScalarBatch, key: str, values: Sequence[tuple[int, int, tuple[Any, ...]]]
) -> tuple[list[tuple[int, int, tuple[float | int, ...]]], int]:
    """Put per-layer statistic values ((statistic, call or layer, its values)) into the
    batch: one float64 part per device (keys (key, k)), made of one stack per dtype (a
    stack of one dtype is exact and fast; a promoting one would round int64 counts beside
    bfloat16 values, and a stack into float64 costs ~1.6 us a value). Returns each entry's
    (statistic, call or layer, its values: an int is the index of a value in the
    concatenation of the parts, a float a host number), in the order of `values`, and the
    number of parts."""
    # device -> dtype -> its tensors; each entry's tensors as (device, dtype, position)
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    placed: list[tuple[int, int, tuple[Any, ...]]] = []
    for statistic, where, items in values:
        slots: list[Any] = []
        for v in items:
            if isinstance(v, torch.Tensor):
                dtypes = by_device.setdefault(v.device, {})
                same = dtypes.setdefault(v.dtype, [])
                slots.append((v.device, v.dtype, len(same)))
                same.append(v)
            else:  # (a host number: a float from values_of, or a built-in's)
                slots.append(float(v))
        placed.append((statistic, where, tuple(slots)))
    offsets: dict[tuple[torch.device, torch.dtype], int] = {}
    total = 0
    for k, (device, dtypes) in enumerate(by_device.items()):
        stacks = []
        for dtype, tensors in dtypes.items():
            offsets[device, dtype] = total
            total += len(tensors)
            stacks.append(torch.stack(tensors))
        size = sum(s.numel() for s in stacks)
        into = torch.empty(size, dtype=torch.float64, device=device)
        batch.add((key, k), torch.cat(stacks, out=into))
    order = [
        (
            statistic,
            where,
            tuple(v if type(v) is float else offsets[v[0], v[1]] + v[2] for v in slots),
        )
        for statistic, where, slots in placed
    ]
    return order, len(by_device)


def _add_activations(batch: ScalarBatch, record: StepRecord) -> list[int]:
    """Stack a record's activation reductions, one stack per device; returns which record
    entry each stacked value is."""
    act_order: list[int] = []
    by_device: dict[torch.device, list[int]] = {}
    for i, a in enumerate(record.act):
        by_device.setdefault(a.low.device, []).append(i)
    for indices in by_device.values():
        act_order.extend(indices)
        batch.add("act_min", torch.stack([record.act[i].low for i in indices]))
        batch.add("act_max", torch.stack([record.act[i].high for i in indices]))
    return act_order
