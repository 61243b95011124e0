"""The per-layer table a person reads: one row model, built from a Snapshot (in the training
process: `print(prof.snapshot())`, `prof.report()`) or from scraped /metrics pages
(`hookprof top`), and rendered as plain text.

Both sources give the same figures, since the page is rendered from the snapshot: times
per call are the run's totals over sampled steps divided by their calls (the summaries'
`_sum / _count`), and a layer's share of the step is its forward plus backward time per
sampled step over the mean time of those same sampled steps
(`hookprof_sampled_step_seconds_total / hookprof_sampled_steps_total`), or over the layers'
own total when that is larger (see _step_seconds). One window for both: a share is never a
sampled step's layer time over a mean that unsampled steps (no hooks, often faster) pulled
down. Sampled steps carry the hooks' own cost, and so do their step times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hookprof import metrics_names as names
from hookprof.snapshot import LAYER_PHASES, PHASES, Snapshot


@dataclass(frozen=True, slots=True)
class LayerRow:
    """One layer of one model on one rank."""

    layer: str
    module: str
    forward_ms: float | None = None
    """Forward milliseconds per call, over the run's sampled steps."""
    backward_ms: float | None = None
    """Backward milliseconds per call, over the run's sampled steps."""
    share: float | None = None
    """(forward + backward seconds per sampled step) / mean step seconds (see _step_seconds)."""
    grad_norm: float | None = None
    """L2 norm of the layer's own parameters' gradients, last sampled step."""
    abs_max: float | None = None
    """Largest |activation| of the layer's outputs, last sampled step."""
    dead_ratio: float | None = None
    """Fraction of exact zeros in the layer's outputs, last sampled step."""
    nonfinite: Mapping[str, int] = field(default_factory=dict)
    """Phase ("forward"/"backward") -> steps on which the layer held a NaN or Inf."""
    first: bool = False
    """The layer is the run's first non-finite offender."""
    rank: int = 0
    model: str = ""


@dataclass(frozen=True, slots=True)
class FirstNonFinite:
    layer: str | None
    phase: str
    step: int
    found_by: str | None = None  # NonFiniteEvent.found_by
    replay: str | None = None  # "reproducible", "transient", "not replayed" (NonFiniteEvent.replay)
    capsule: str | None = None  # the incident capsule's path (NonFiniteEvent.capsule)


@dataclass(frozen=True, slots=True)
class RunHeader:
    """The step-level figures of one model on one rank."""

    rank: int = 0
    model: str = ""
    steps: int = 0
    sampled_steps: int = 0
    sampled_step_seconds: float | None = None
    """Wall time summed over the sampled steps (None: an endpoint from before it was kept)."""
    step_buckets: tuple[tuple[float, float], ...] = ()
    """(upper bound in seconds, cumulative count), the last bound +inf."""
    step_seconds_sum: float = 0.0
    loss: float | None = None
    grad_norm: float | None = None
    nonfinite_steps: Mapping[str, int] = field(default_factory=dict)
    skipped_steps: int = 0
    first_nonfinite: FirstNonFinite | None = None
    dropped: tuple[int, int | None, str | None] | None = None
    """Steps whose non-finite gradients the loop dropped before any update (no incident):
    (how many, the first's step, its first layer), the last two None while unknown."""
    steps_per_s: float | None = None
    """Only from two observations (hookprof top); None from a single one."""
    window_buckets: tuple[tuple[float, float], ...] | None = None
    """The step histogram between two observations, when known: its quantiles are the
    recent ones; otherwise the run's."""
    position: str | None = None
    """Where the training thread is: "step 12, forward for 0.4 s" (docs/stalls.md)."""
    stall: str | None = None
    """The stall going on now, in words; None while the run moves."""
    recent: str | None = None
    spikes: Mapping[str, tuple[int, int | None]] = field(default_factory=dict)
    """Kind -> (spike events, the latest's first step): publish/spikes.py."""
    replay_checks: Mapping[str, int] = field(default_factory=dict)
    """The replay check's steps by result (hookprof/integrity/); empty while it is off."""
    replay_mismatch: tuple[str, int] | None = None
    """(layer, step) of the last check whose replay did not reproduce its forward."""
    spike_replays: Mapping[str, int] = field(default_factory=dict)
    """The spike replay's steps by result (integrity/spike_replay.py); empty while off."""
    spike_mismatch: tuple[str, int, str] | None = None
    """(layer, step, phase) of the last spike whose replay did not reproduce its step (phase
    "backward": the forward alike, that layer's output's gradient differed first;
    "parameter_gradient": that parameter's own gradient, all else alike)."""
    """The last steps' loss and gradient norm, one character each (view/recent.py); None
    where the endpoint was not asked for them (`top` asks /history.json?recent)."""

    @property
    def mean_step_seconds(self) -> float | None:
        return self.step_seconds_sum / self.steps if self.steps else None

    @property
    def mean_sampled_step_seconds(self) -> float | None:
        """The sampled steps' mean wall time: the window of the per-layer times."""
        if not self.sampled_steps or not self.sampled_step_seconds:
            return None
        return self.sampled_step_seconds / self.sampled_steps

    def step_quantile(self, q: float) -> float | None:
        return quantile(q, self.window_buckets or self.step_buckets)


@dataclass(frozen=True, slots=True)
class RunTable:
    header: RunHeader
    rows: tuple[LayerRow, ...]


# ---------------- the figures ----------------


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket the rank falls
    in, the lowest bucket starting at 0, a rank in the +Inf bucket answered with the largest
    finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_window(
    now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
) -> tuple[tuple[float, float], ...] | None:
    """The histogram of the observations between two cumulative ones (same bounds)."""
    if [b for b, _ in now] != [b for b, _ in before]:
        return None
    window = tuple((b, c - c0) for (b, c), (_, c0) in zip(now, before))
    return window if window and window[-1][1] > 0 else None


def _per_call_ms(seconds: float, calls: int | float) -> float | None:
    return seconds / calls * 1e3 if calls else None


def _step_seconds(header: RunHeader, layer_seconds: Iterable[float]) -> float | None:
    """What shares are of: the mean time of the sampled steps, the steps the layers' times
    come from (the mean of all steps from an endpoint that did not keep it); or, when the
    layers alone took longer per sampled step, the layers' total, so that shares never add
    up to more than 100%."""
    mean = header.mean_sampled_step_seconds or header.mean_step_seconds
    if not header.sampled_steps or not mean:
        return None
    return max(mean, sum(layer_seconds) / header.sampled_steps)


def _share(
    layer_seconds: float, calls: float, header: RunHeader, step_seconds: float | None
) -> float | None:
    if not calls or step_seconds is None:  # never timed: no share, not 0%
        return None
    return layer_seconds / header.sampled_steps / step_seconds


# ---------------- source 1: a Snapshot ----------------


def from_snapshot(snap: Snapshot, model: str = "") -> RunTable:
    first = snap.first_nonfinite
    header = RunHeader(
        rank=snap.rank,
        model=model,
        steps=snap.step,
        sampled_steps=snap.sampled_steps,
        sampled_step_seconds=snap.sampled_step_seconds,
        step_buckets=tuple((float(b), float(c)) for b, c in snap.step_duration_buckets),
        step_seconds_sum=snap.step_duration_sum,
        loss=snap.loss,
        grad_norm=snap.grad_norm,
        nonfinite_steps=dict(snap.nonfinite_steps),
        skipped_steps=snap.skipped_steps,
        dropped=None
        if snap.dropped_nonfinite is None
        else (
            snap.dropped_nonfinite.steps,
            snap.dropped_nonfinite.first_step,
            snap.dropped_nonfinite.layer,
        ),
        first_nonfinite=FirstNonFinite(
            first.layer, first.phase, first.step, first.found_by, first.replay, first.capsule
        )
        if first
        else None,
        position=_position(snap.progress.step, snap.progress.phase, snap.progress.phase_seconds)
        if snap.progress is not None
        else None,
        stall=_stall(snap.stall.step, snap.stall.phase, snap.stall.layer, snap.stall.waiting_on)
        if snap.stall is not None
        else None,
        spikes={
            kind: (count.count, count.last.step if count.last is not None else None)
            for kind, count in snap.spikes.items()
        },
        replay_checks=dict(snap.replay_checks),
        replay_mismatch=(snap.replay_mismatch.layer, snap.replay_mismatch.step)
        if snap.replay_mismatch is not None
        else None,
        spike_replays=dict(snap.spike_replays),
        spike_mismatch=(
            snap.spike_mismatch.layer,
            snap.spike_mismatch.step,
            snap.spike_mismatch.phase,
        )
        if snap.spike_mismatch is not None
        else None,
    )
    rows = []
    step_seconds = _step_seconds(
        header,
        (
            layer.forward_seconds_total + layer.backward_seconds_total
            for layer in snap.layers.values()
        ),
    )
    for name, layer in snap.layers.items():
        rows.append(
            LayerRow(
                layer=name,
                module=layer.module,
                forward_ms=_per_call_ms(layer.forward_seconds_total, layer.forward_calls_total),
                backward_ms=_per_call_ms(layer.backward_seconds_total, layer.backward_calls_total),
                share=_share(
                    layer.forward_seconds_total + layer.backward_seconds_total,
                    layer.forward_calls_total + layer.backward_calls_total,
                    header,
                    step_seconds,
                ),
                grad_norm=layer.grad_norm,
                abs_max=layer.activation_abs_max,
                dead_ratio=layer.activation_zero_ratio,
                nonfinite={
                    p: layer.nonfinite.get(p, 0) for p in LAYER_PHASES if layer.nonfinite.get(p, 0)
                },
                first=first is not None and first.layer == name,
                rank=snap.rank,
                model=model,
            )
        )
    return RunTable(header, tuple(rows))


# ---------------- source 2: scraped /metrics pages ----------------


class _Run:
    """What one (model, rank) pair's series say, gathered while reading a page."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {"nonfinite_steps": {}}
        self.buckets: list[tuple[float, float]] = []
        self.layers: dict[str, dict[str, Any]] = {}

    def layer(self, name: str) -> dict[str, Any]:
        return self.layers.setdefault(name, {"nonfinite": {}})


# sample name -> key: run-level figures, then per-layer ones
_RUN_SAMPLES = {
    names.STEPS_TOTAL.name: "steps",
    names.SAMPLED_STEPS_TOTAL.name: "sampled_steps",
    names.SAMPLED_STEP_SECONDS_TOTAL.name: "sampled_step_seconds",
    names.STEP_DURATION_SECONDS.sample("sum"): "step_seconds_sum",
    names.LOSS.name: "loss",
    names.GRADIENT_NORM.name: "grad_norm",
    names.SKIPPED_STEPS_TOTAL.name: "skipped_steps",
    names.DROPPED_NONFINITE_STEPS_TOTAL.name: "dropped_steps",
}
_LAYER_SAMPLES = {
    names.LAYER_FORWARD_SECONDS.sample("sum"): "fwd_sum",
    names.LAYER_FORWARD_SECONDS.sample("count"): "fwd_count",
    names.LAYER_BACKWARD_SECONDS.sample("sum"): "bwd_sum",
    names.LAYER_BACKWARD_SECONDS.sample("count"): "bwd_count",
    names.LAYER_GRADIENT_NORM.name: "grad_norm",
    names.LAYER_ACTIVATION_ABS_MAX.name: "abs_max",
    names.LAYER_ACTIVATION_ZERO_RATIO.name: "dead_ratio",
}
_STEP_BUCKET = names.STEP_DURATION_SECONDS.sample("bucket")
_RUN_COUNTS = (
    "steps",
    "sampled_steps",
    "skipped_steps",
    "dropped_steps",
)  # read as ints: int() of NaN raised


# the families a process's endpoint serves once (found on the first GPU run: the CUDA
# allocator gauges carry `rank` and made a second, empty table named "")
_PER_PROCESS = frozenset(m.family_name for m in names.ALL if not m.per_model)


def from_metrics(text: str) -> list[RunTable]:
    """The tables of one /metrics page: one per (model, rank) whose hookprof series it holds
    (several models can share a process's endpoint). Parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    runs: dict[tuple[str, int], _Run] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (
        ValueError
    ) as exc:  # an HTML page, garbage: the parser's words, on the line it stopped at
        raise ValueError(f"not the Prometheus text format: {exc}") from None
    for family in families:
        if not family.name.startswith(names.PREFIX) or family.name in _PER_PROCESS:
            continue  # per-process series (CUDA allocator, GPUs) carry a rank but no model
        for s in family.samples:
            if "rank" not in s.labels:
                continue
            try:
                key = (
                    s.labels.get(names.MODEL_LABEL, ""),
                    _whole(s.labels["rank"], "the rank label"),
                )
                _read_sample(runs.setdefault(key, _Run()), s.name, s.labels, s.value)
            except KeyError as exc:
                raise ValueError(f"{s.name} without its {exc.args[0]} label") from None
            except ValueError as exc:
                raise ValueError(f"{s.name}: {exc}") from None
    return [_table(model, rank, run) for (model, rank), run in sorted(runs.items())]


def _whole(value: Any, what: str) -> int:
    """A count or a rank or step label read from a page, as an int; ValueError naming `what`
    for anything else (NaN, an infinity, "abc"): int() raised on them from deep in top."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number.is_integer():
        raise ValueError(f"{what} is {str(value)[:40]!r}, not a whole number")
    return int(number)


def _read_sample(run: _Run, name: str, labels: Mapping[str, str], value: float) -> None:
    if name in _RUN_SAMPLES:
        key = _RUN_SAMPLES[name]
        run.values[key] = _whole(value, "the count") if key in _RUN_COUNTS else value
    elif name == _STEP_BUCKET:
        run.buckets.append((float(labels["le"]), value))
    elif name == names.NONFINITE_STEPS_TOTAL.name:
        run.values["nonfinite_steps"][labels["phase"]] = _whole(value, "the count")
    elif name == names.FIRST_NONFINITE_INFO.name:
        run.values["first_layer"] = labels["layer"]
        run.values["first_at"] = (labels["phase"], _whole(labels["step"], "the step label"))
    elif name == names.FIRST_NONFINITE_ORIGIN_INFO.name:
        run.values["first_origin"] = (labels["found_by"] or None, labels["replay"] or None)
        run.values["first_at"] = (labels["phase"], _whole(labels["step"], "the step label"))
    elif name == names.FIRST_DROPPED_NONFINITE_INFO.name:
        run.values["dropped_first"] = (_whole(labels["step"], "the step label"), labels["layer"])
    elif name == names.FIRST_NONFINITE_CAPSULE_INFO.name:
        run.values["first_capsule"] = labels["path"]
    elif name == names.SPIKES_TOTAL.name:
        run.values.setdefault("spikes", {})[labels["kind"]] = _whole(value, "the count")
    elif name == names.SPIKE_LAST_STEP.name:
        run.values.setdefault("spike_last", {})[labels["kind"]] = _whole(value, "the step")
    elif name == names.REPLAY_CHECKS_TOTAL.name:
        run.values.setdefault("replay_checks", {})[labels["result"]] = _whole(value, "the count")
    elif name == names.SPIKE_REPLAYS_TOTAL.name:
        run.values.setdefault("spike_replays", {})[labels["result"]] = _whole(value, "the count")
    elif name == names.REPLAY_MISMATCH_INFO.name:
        run.values["replay_mismatch"] = (labels["layer"], _whole(labels["step"], "the step"))
    elif name == names.SPIKE_MISMATCH_INFO.name:
        run.values["spike_mismatch"] = (
            labels["layer"],
            _whole(labels["step"], "the step"),
            labels.get("phase", "forward"),
        )
    elif name in _LAYER_SAMPLES:
        layer = run.layer(labels["layer"])
        layer[_LAYER_SAMPLES[name]] = value
        if "module" in labels:
            layer["module"] = labels["module"]
    elif name == names.STALL_INFO.name:
        run.values["stall"] = _stall(
            _whole(labels["step"], "the step label"),
            labels["phase"],
            labels["layer"],
            labels["waiting_on"],
        )
    elif name == names.PROGRESS_STEP.name:
        run.values["progress_step"] = _whole(value, "the step")
    elif name == names.PROGRESS_PHASE.name:
        run.values["progress_phase"] = labels["phase"]
    elif name == names.PROGRESS_PHASE_SECONDS.name:
        run.values["progress_seconds"] = value
    elif name == names.LAYER_NONFINITE_TOTAL.name:
        run.layer(labels["layer"])["nonfinite"][labels["phase"]] = _whole(value, "the count")


def _table(model: str, rank: int, run: _Run) -> RunTable:
    v = run.values
    header = RunHeader(
        rank=rank,
        model=model,
        steps=int(v.get("steps", 0)),
        sampled_steps=int(v.get("sampled_steps", 0)),
        sampled_step_seconds=v.get("sampled_step_seconds"),
        step_buckets=tuple(sorted(run.buckets)),
        step_seconds_sum=v.get("step_seconds_sum", 0.0),
        loss=v.get("loss"),
        grad_norm=v.get("grad_norm"),
        nonfinite_steps={p: v["nonfinite_steps"].get(p, 0) for p in PHASES},
        skipped_steps=int(v.get("skipped_steps", 0)),
        first_nonfinite=_first(v),
        dropped=(int(v["dropped_steps"]), *v.get("dropped_first", (None, None)))
        if v.get("dropped_steps")
        else None,
        position=_position(
            int(v["progress_step"]), v.get("progress_phase", "?"), v.get("progress_seconds", 0.0)
        )
        if "progress_step" in v
        else None,
        stall=v.get("stall"),
        spikes={
            kind: (count, v.get("spike_last", {}).get(kind))
            for kind, count in v.get("spikes", {}).items()
        },
        replay_checks=v.get("replay_checks", {}),
        replay_mismatch=v.get("replay_mismatch"),
        spike_replays=v.get("spike_replays", {}),
        spike_mismatch=v.get("spike_mismatch"),
    )
    first = header.first_nonfinite
    rows = []
    step_seconds = _step_seconds(
        header,
        (layer.get("fwd_sum", 0.0) + layer.get("bwd_sum", 0.0) for layer in run.layers.values()),
    )
    for name, layer in run.layers.items():
        rows.append(
            LayerRow(
                layer=name,
                module=layer.get("module", ""),
                forward_ms=_per_call_ms(layer.get("fwd_sum", 0.0), layer.get("fwd_count", 0)),
                backward_ms=_per_call_ms(layer.get("bwd_sum", 0.0), layer.get("bwd_count", 0)),
                share=_share(
                    layer.get("fwd_sum", 0.0) + layer.get("bwd_sum", 0.0),
                    layer.get("fwd_count", 0) + layer.get("bwd_count", 0),
                    header,
                    step_seconds,
                ),
                grad_norm=layer.get("grad_norm"),
                abs_max=layer.get("abs_max"),
                dead_ratio=layer.get("dead_ratio"),
                nonfinite={p: c for p, c in layer["nonfinite"].items() if c},
                first=first is not None and first.layer == name,
                rank=rank,
                model=model,
            )
        )
    return RunTable(header, tuple(rows))


# ---------------- source 3: a run report's document ----------------


def from_document(doc: Mapping[str, Any]) -> RunTable:
    """The table of a run report's document (publish/document.py: a snapshot's exported
    layers, in the training process or read back from /history.json): the figures `hookprof
    top` shows for the same snapshot, since both divide the same totals here. A document from
    an older endpoint lacks the call counts and activation figures: those cells are "-"."""
    first = doc.get("first_nonfinite")
    steps = int(doc["steps"])
    mean = doc.get("step_seconds_mean")
    header = RunHeader(
        rank=int(doc["rank"]),
        model=str(doc["model"]),
        steps=steps,
        sampled_steps=int(doc["sampled_steps"]),
        sampled_step_seconds=doc.get("sampled_step_seconds_sum"),
        step_seconds_sum=doc.get("step_seconds_sum", (mean or 0.0) * steps),
        loss=doc.get("loss"),
        grad_norm=doc.get("grad_norm"),
        nonfinite_steps=dict(doc["nonfinite_steps"]),
        skipped_steps=int(doc.get("skipped_steps", 0)),
        dropped=_dropped_of(doc.get("dropped_nonfinite")),
        spikes={
            kind: (int(s["count"]), int(s["last"]["step"]) if s.get("last") else None)
            for kind, s in (doc.get("spikes") or {}).items()
        },
        replay_checks=dict(doc.get("replay_checks") or {}),
        replay_mismatch=(doc["replay_mismatch"]["layer"], int(doc["replay_mismatch"]["step"]))
        if doc.get("replay_mismatch")
        else None,
        spike_replays=dict(doc.get("spike_replays") or {}),
        spike_mismatch=(
            doc["spike_mismatch"]["layer"],
            int(doc["spike_mismatch"]["step"]),
            doc["spike_mismatch"].get("phase", "forward"),
        )
        if doc.get("spike_mismatch")
        else None,
        first_nonfinite=FirstNonFinite(
            first["layer"],
            first["phase"],
            int(first["step"]),
            first.get("found_by"),
            first.get("replay"),
        )
        if first
        else None,
    )
    layers = doc["layer_totals"]
    totals = [
        (
            layer.get("forward_seconds_total", 0.0),
            layer.get("forward_calls", 0),
            layer.get("backward_seconds_total", 0.0),
            layer.get("backward_calls", 0),
        )
        for layer in layers
    ]
    step_seconds = _step_seconds(header, (f + b for f, _, b, _ in totals))
    rows = []
    for layer, (fwd, fwd_calls, bwd, bwd_calls) in zip(layers, totals):
        nonfinite = layer.get("nonfinite") or {}
        rows.append(
            LayerRow(
                layer=layer["name"],
                module=layer["module"],
                forward_ms=_per_call_ms(fwd, fwd_calls),
                backward_ms=_per_call_ms(bwd, bwd_calls),
                share=_share(fwd + bwd, fwd_calls + bwd_calls, header, step_seconds),
                grad_norm=layer.get("grad_norm"),
                abs_max=layer.get("activation_abs_max"),
                dead_ratio=layer.get("activation_zero_ratio"),
                nonfinite={p: nonfinite[p] for p in LAYER_PHASES if nonfinite.get(p)},
                first=first is not None and first["layer"] == layer["name"],
                rank=header.rank,
                model=header.model,
            )
        )
    return RunTable(header, tuple(rows))


def with_rates(now: RunTable, before: RunTable | None, seconds: float) -> RunTable:
    """`now` with steps/s and the recent step-time histogram, from an earlier observation
    of the same run `seconds` before."""
    if before is None or seconds <= 0 or now.header.steps < before.header.steps:
        return now  # the first look, or the process restarted
    rate = (now.header.steps - before.header.steps) / seconds
    window = bucket_window(now.header.step_buckets, before.header.step_buckets)
    return RunTable(replace(now.header, steps_per_s=rate, window_buckets=window), now.rows)


# ---------------- sorting, filtering, choosing ----------------

# sort key -> (column title, the row's value, largest first?)
COLUMNS: dict[str, tuple[str, Any, bool]] = {
    "share": ("share", lambda r: r.share, True),
    "forward": ("fwd ms/call", lambda r: r.forward_ms, True),
    "backward": ("bwd ms/call", lambda r: r.backward_ms, True),
    "grad": ("grad norm", lambda r: r.grad_norm, True),
    "absmax": ("|act| max", lambda r: r.abs_max, True),
    "dead": ("dead", lambda r: r.dead_ratio, True),
    "nan": ("NaN", lambda r: (r.first, sum(r.nonfinite.values())), True),
    "layer": ("layer", lambda r: r.layer, False),
}


def sort_rows(rows: Iterable[LayerRow], by: str = "share", reverse: bool = False) -> list[LayerRow]:
    """Rows ordered by column `by` (largest first for figures, a-z for names; `reverse`
    flips it). Rows without the figure go last either way; ties keep model order."""
    _, value, largest_first = COLUMNS[by]
    rows = list(rows)
    known = [r for r in rows if _sortable(value(r))]
    unknown = [r for r in rows if not _sortable(value(r))]
    descending = largest_first != reverse
    known.sort(key=lambda r: _nan_low(value(r)), reverse=descending)
    return known + unknown


def _sortable(v: Any) -> bool:
    return v is not None


def _nan_low(v: Any) -> Any:
    # a NaN figure (the very thing being looked for) sorts as the largest
    if isinstance(v, float) and math.isnan(v):
        return math.inf
    return v


def filter_rows(rows: Iterable[LayerRow], text: str) -> list[LayerRow]:
    """Rows whose layer name (or module type) contains `text`, ignoring case."""
    needle = text.lower()
    return [r for r in rows if needle in r.layer.lower() or needle in r.module.lower()]


def choose(rows: Sequence[LayerRow], limit: int | None) -> tuple[list[LayerRow], int]:
    """The first `limit` rows plus every row that went non-finite (a table cut short must
    never hide the offender); returns them and how many were left out."""
    if limit is None or len(rows) <= limit:
        return list(rows), 0
    shown = list(rows[:limit]) + [r for r in rows[limit:] if r.first or r.nonfinite]
    return shown, len(rows) - len(shown)


# ---------------- plain text ----------------


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def fmt_share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt_num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def fmt_seconds(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


def nan_marks(row: LayerRow) -> str:
    """ "first" for the run's first offender, then F<n>/B<n>: steps on which its outputs
    (forward) or gradients (backward) held a NaN or Inf."""
    marks = ["first"] if row.first else []
    marks += [f"{p[0].upper()}{row.nonfinite[p]}" for p in LAYER_PHASES if row.nonfinite.get(p)]
    return " ".join(marks)


def cells(row: LayerRow) -> list[str]:
    """The row as the table shows it, in TITLES' order (after rank/model, when shown)."""
    return [
        row.layer,
        row.module,
        fmt_ms(row.forward_ms),
        fmt_ms(row.backward_ms),
        fmt_share(row.share),
        fmt_num(row.grad_norm),
        fmt_num(row.abs_max),
        fmt_ratio(row.dead_ratio),
        nan_marks(row),
    ]


TITLES = [
    "layer",
    "module",
    "fwd ms/call",
    "bwd ms/call",
    "share",
    "grad norm",
    "|act| max",
    "dead",
    "NaN",
]
_LEFT = {"layer", "module", "NaN", "rank", "model"}


def header_line(h: RunHeader) -> str:
    who = f"rank {h.rank}" + (f"  model {h.model}" if h.model else "")
    parts = [who, f"step {h.steps} ({h.sampled_steps} sampled)"]
    if h.steps_per_s is not None:
        parts.append(f"{h.steps_per_s:.1f} steps/s")
    parts.append(
        f"step time p50 {fmt_seconds(h.step_quantile(0.5))} p95 {fmt_seconds(h.step_quantile(0.95))}"
    )
    parts.append(f"loss {fmt_num(h.loss)}")
    parts.append(f"grad norm {fmt_num(h.grad_norm)}")
    if h.position is not None:
        parts.append(h.position)
    return "  ".join(parts)


def _position(step: int, phase: str, seconds: float) -> str:
    return f"now: step {step}, {phase} for {fmt_seconds(seconds)}"


def _stall(step: int, phase: str, layer: str, waiting_on: str) -> str:
    return f"STALLED at step {step} in {phase}, innermost layer {layer}, waiting on {waiting_on}"


def _first(values: dict[str, Any]) -> FirstNonFinite | None:
    """The first NaN/Inf from a scraped page: its layer (hookprof_first_nonfinite_info, once
    named) and how it was settled (hookprof_first_nonfinite_origin_info)."""
    if "first_at" not in values:
        return None
    phase, step = values["first_at"]
    found_by, replay = values.get("first_origin", (None, None))
    return FirstNonFinite(
        values.get("first_layer"), phase, step, found_by, replay, values.get("first_capsule")
    )


def first_words(f: FirstNonFinite) -> str:
    """The first NaN/Inf in a few words: the layer, and in brackets how it was found and what
    its replay said ("mlp.0 (forward) at step 5 [sampled step; reproducible]"; "no layer
    (forward) at step 7 [transient]")."""
    settled = f.layer is not None or f.replay is not None
    where = f.layer if f.layer is not None else "no layer" if settled else "(not yet localised)"
    how = "; ".join(x for x in (f.found_by, f.replay) if x)
    return f"{where} ({f.phase}) at step {f.step}" + (f" [{how}]" if how else "")


def _dropped_of(doc: Mapping[str, Any] | None) -> tuple[int, int | None, str | None] | None:
    return None if not doc else (int(doc["steps"]), int(doc["first_step"]), doc.get("layer"))


def nonfinite_line(h: RunHeader) -> str:
    counts = {p: h.nonfinite_steps.get(p, 0) for p in PHASES}
    if not any(counts.values()):
        text = "non-finite steps: none"
    else:
        text = "non-finite steps: " + ", ".join(f"{p} {c}" for p, c in counts.items())
    if h.first_nonfinite is not None:
        f = h.first_nonfinite
        text += f"; first: {first_words(f)}"
    if h.skipped_steps:
        text += f"; GradScaler skipped {h.skipped_steps} steps"
    if h.dropped is not None:
        count, step, layer = h.dropped
        plural = "s" if count != 1 else ""
        text += f"; the loop dropped the non-finite gradients of {count} step{plural} (no incident"
        text += (
            f"; first: {layer or 'a layer not yet named'} at step {step})"
            if step is not None
            else ")"
        )
    if h.first_nonfinite is not None and h.first_nonfinite.capsule:
        text += f"; capsule: {h.first_nonfinite.capsule} (hookprof replay it)"
    return text


def spike_line(h: RunHeader) -> str | None:
    """The loss and gradient-norm spikes so far, when there were any (publish/spikes.py)."""
    seen = [(kind, count, last) for kind, (count, last) in h.spikes.items() if count]
    if not seen:
        return None
    return "spikes (no NaN): " + ", ".join(
        f"{kind.replace('_', ' ')} {count}" + (f" (latest from step {last})" if last else "")
        for kind, count, last in seen
    )


def replay_line(h: RunHeader) -> str | None:
    """The replay check's verdicts so far, when it is on (hookprof/integrity/replay_check.py)."""
    if not h.replay_checks:
        return None
    counts = h.replay_checks
    text = (
        f"replay checks: {counts.get('reproduced', 0)} reproduced, "
        f"{counts.get('not_reproduced', 0)} not reproduced"
    )
    if h.replay_mismatch is not None:
        layer, step = h.replay_mismatch
        text += f" (latest: {layer}'s output differed at step {step}: the machine, not the data)"
    if counts.get("not_compared"):
        text += f", {counts['not_compared']} not compared"
    return text


def spike_replay_line(h: RunHeader) -> str | None:
    """The spike replay's verdicts so far, when it is on (integrity/spike_replay.py)."""
    if not h.spike_replays:
        return None
    counts = h.spike_replays
    text = (
        f"spike replays: {counts.get('reproduced', 0)} reproduced (the data), "
        f"{counts.get('not_reproduced', 0)} not reproduced (the machine)"
    )
    if h.spike_mismatch is not None:
        layer, step, phase = h.spike_mismatch
        text += f" (latest: step {step}, {first_differing_text(layer, phase)})"
    if counts.get("not_compared"):
        text += f", {counts['not_compared']} not compared"
    return text


def first_differing_text(layer: str, phase: str | None) -> str:
    """Where a spike replay's difference was first seen, as the views say it: a layer's
    output, or (phase "backward", the forward alike) the gradient of a layer's output, which
    the backward of what takes that output made, or (phase "parameter_gradient", the forward
    and every layer's output gradient alike) a parameter's own gradient (`layer` is then the
    parameter's name), which its layer's backward made, or (phase "update") a parameter's
    update, which the optimizer made differently when run again from the same gradients,
    weights and state (an update ratio jump's verdict)."""
    if phase == "update":
        return f"the optimizer's update of {layer} differs when run again"
    if phase == "parameter_gradient":
        return f"forward and output gradients alike, first differing: {layer}'s gradient"
    if phase == "backward":
        return f"forward alike, first differing gradient: of {layer}'s output"
    return f"first differing output {layer}'s"


def header_lines(headers: Sequence[RunHeader]) -> list[str]:
    lines = []
    for h in headers:
        lines += [header_line(h), "  " + nonfinite_line(h)]
        spikes = spike_line(h)
        if spikes is not None:
            lines.append("  " + spikes)
        replays = replay_line(h)
        if replays is not None:
            lines.append("  " + replays)
        spike_replays = spike_replay_line(h)
        if spike_replays is not None:
            lines.append("  " + spike_replays)
        if h.stall is not None:  # only while a rank is stuck (docs/stalls.md)
            lines.append("  " + h.stall)
        if h.recent is not None:
            lines.append("  " + h.recent)
    return lines


def row_cells(rows: Sequence[LayerRow], several_runs: bool) -> tuple[list[str], list[list[str]]]:
    """Titles and cells, with rank and model columns when rows come from several runs."""
    titles = list(TITLES)
    body = [cells(r) for r in rows]
    if several_runs:
        models = {r.model for r in rows}
        if len(models) > 1:
            titles.insert(0, "model")
            body = [[r.model, *c] for r, c in zip(rows, body)]
        titles.insert(0, "rank")
        body = [[str(r.rank), *c] for r, c in zip(rows, body)]
    return titles, body


def render_rows(rows: Sequence[LayerRow], several_runs: bool = False) -> list[str]:
    titles, body = row_cells(rows, several_runs)
    widths = [
        max(len(t), *(len(c[i]) for c in body)) if body else len(t) for i, t in enumerate(titles)
    ]

    def line(values: Sequence[str]) -> str:
        out = [v.ljust(w) if t in _LEFT else v.rjust(w) for t, v, w in zip(titles, values, widths)]
        return "  ".join(out).rstrip()

    return [line(titles), *(line(c) for c in body)]


def render(
    tables: Sequence[RunTable],
    *,
    by: str = "share",
    reverse: bool = False,
    name_filter: str = "",
    limit: int | None = 25,
) -> str:
    """Header lines, then the layers of every table in one list, sorted and filtered."""
    rows = [r for t in tables for r in t.rows]
    if name_filter:
        rows = filter_rows(rows, name_filter)
    shown, left_out = choose(sort_rows(rows, by, reverse), limit)
    lines = header_lines([t.header for t in tables])
    if not rows:
        lines.append("(no layers" + (f" matching {name_filter!r})" if name_filter else ")"))
    else:
        lines += render_rows(shown, several_runs=len(tables) > 1)
    if left_out:
        lines.append(f"... {left_out} more layers not shown")
    return "\n".join(lines)


def report_text(snap: Snapshot, model: str = "") -> str:
    """Profiler.report()'s text: the header and every layer (no limit)."""
    return render([from_snapshot(snap, model)], limit=None)
