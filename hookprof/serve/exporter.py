"""Prometheus exposition: a custom Collector that renders the latest Snapshot, and the
per-profiler registry (the HTTP server is hookprof/serve/server.py). Names, types, labels and
help come from hookprof/metrics_names.py (the contract: docs/metrics.md)."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hookprof import metrics_names as names
from hookprof._version import __version__
from hookprof.efficiency.families import efficiency_families
from hookprof.faults import PARTS, Faults, log
from hookprof.metrics_names import family
from hookprof.phases.families import progress_families
from hookprof.serve.system import PsutilProcessCollector, has_proc_fs
from hookprof.snapshot import LAYER_PHASES, PHASES, SPIKE_KINDS, Snapshot
from hookprof.step.record import StepCounters

_HOST = socket.gethostname()  # the hookprof_first_nonfinite_origin_info `host` label


class SnapshotCollector(Collector):
    """Builds metric families from `get_snapshot()` at scrape time. Never touches the device
    or the hooks; reads one immutable object. With `model`, every series it makes carries
    that `model` label (several models share a process's endpoint); `build_info` False
    leaves hookprof_build_info to the endpoint, which serves it once.

    `publisher_alive`: False while the publisher cannot publish (its thread died, or its
    snapshot build keeps failing), so the snapshot is stale. `faults` and `counters` (read
    at scrape time; both are safe to read from another thread): the internal errors and the
    step count go out from them, not only from the snapshot, so that a snapshot that cannot
    be built, or cannot be rendered, still shows its faults and the steps taken."""

    def __init__(
        self,
        get_snapshot: Callable[[], Snapshot],
        torch_version: str,
        publisher_alive: Callable[[], bool] = lambda: True,
        rank: int = 0,
        model: str | None = None,
        build_info: bool = True,
        faults: Faults | None = None,
        counters: StepCounters | None = None,
    ):
        self._get_snapshot = get_snapshot
        self._torch_version = torch_version
        self._publisher_alive = publisher_alive
        self._faults = faults
        self._counters = counters
        self._failed = False  # logged once
        self._rank = str(rank)  # for the series that go out even when the snapshot fails
        self._model = model
        self._build_info = build_info

    def describe(self) -> list[Metric]:
        return []  # names are dynamic per snapshot; skip the registry's duplicate check

    def collect(self) -> Iterator[Metric]:
        if self._model is None:
            yield from self._families()
            return
        for built in self._families():
            if built.name != names.BUILD_INFO.name:
                built.samples = [
                    s._replace(labels={**s.labels, names.MODEL_LABEL: self._model})
                    for s in built.samples
                ]
            yield built

    def _families(self) -> Iterator[Metric]:
        rank = self._rank
        # read at scrape time, not from the snapshot: a dead publisher publishes nothing
        up = self._publisher_alive()
        try:
            snap = self._get_snapshot()
            rank = str(snap.rank)
            # built whole before the first yield: a failure leaves no half-rendered page
            families = [
                *self._step_metrics(snap, rank, up),
                *self._layer_metrics(snap, rank),
                *progress_families(snap, rank),
                *efficiency_families(snap, rank),
            ]
        except Exception:  # a scrape must not fail: the thread gauge and build info still go out
            families = [*self._live_counts(rank, None, None)]
            if not self._failed:
                self._failed = True
                log.error(
                    "hookprof: rendering the snapshot failed; serving the rest", exc_info=True
                )
        yield from families

        yield _one(names.PUBLISHER_THREAD_UP, rank, 1.0 if up else 0.0)

        if not self._build_info:
            return
        build = family(names.BUILD_INFO)
        build.add_metric([__version__, self._torch_version], 1)
        yield build

    def _live_counts(self, rank: str, steps: int | None, errors: int | None) -> Iterator[Metric]:
        """hookprof_steps_total from the step counters (`steps`: the snapshot's, used while
        the publisher publishes, so that the page agrees with itself) and
        hookprof_internal_errors_total from the faults as they are now, by part. Without
        counters or faults (a caller's own snapshot source), the snapshot's figures only (its
        errors under part "other": it does not say where)."""
        if steps is None and self._counters is not None:
            steps = self._counters.steps
        if steps is not None:
            yield _one(names.STEPS_TOTAL, rank, steps)
        if self._faults is not None:
            by_part = dict(self._faults.by_part)
        elif errors is not None:  # the snapshot says how many, not where
            by_part = {**dict.fromkeys(PARTS, 0), "other": errors}
        else:
            return
        internal = family(names.INTERNAL_ERRORS_TOTAL)
        for part, count in by_part.items():  # every part, 0 included: increase() sees the first
            internal.add_metric([rank, part], count)
        yield internal

    def _step_metrics(self, snap: Snapshot, rank: str, up: bool = True) -> Iterator[Metric]:
        live = self._live_counts(
            rank, snap.step if up or self._counters is None else None, snap.internal_errors
        )
        yield next(live)  # hookprof_steps_total
        yield _one(names.SAMPLED_STEPS_TOTAL, rank, snap.sampled_steps)
        yield _one(names.SAMPLED_STEP_SECONDS_TOTAL, rank, snap.sampled_step_seconds)

        duration = family(names.STEP_DURATION_SECONDS)
        buckets = [(_le(b), c) for b, c in snap.step_duration_buckets] or [("+Inf", 0)]
        duration.add_metric([rank], buckets, snap.step_duration_sum)
        yield duration

        # absent until there is a value: no step yet, no loss given, no sampled step yet
        for metric, value in (
            (names.LAST_STEP_TIMESTAMP_SECONDS, snap.last_step_timestamp),
            (names.LOSS, snap.loss),
            (names.GRADIENT_NORM, snap.grad_norm),
        ):
            if value is not None:
                yield _one(metric, rank, value)

        nonfinite = family(names.NONFINITE_STEPS_TOTAL)
        for phase in PHASES:  # pre-initialised to 0 so that increase() sees the first one
            nonfinite.add_metric([rank, phase], snap.nonfinite_steps.get(phase, 0))
        yield nonfinite

        yield _one(names.SKIPPED_STEPS_TOTAL, rank, snap.skipped_steps)
        dropped = snap.dropped_nonfinite
        yield _one(
            names.DROPPED_NONFINITE_STEPS_TOTAL, rank, 0 if dropped is None else dropped.steps
        )
        if dropped is not None and dropped.layer is not None:
            first_dropped = family(names.FIRST_DROPPED_NONFINITE_INFO)
            first_dropped.add_metric([rank, dropped.layer, str(dropped.first_step)], 1)
            yield first_dropped
        yield _one(names.HELD_BACK_UPDATES_TOTAL, rank, snap.held_back_updates)
        yield _one(names.CAPSULES_WRITTEN_TOTAL, rank, snap.capsules_written)

        flagged = family(names.GRADIENT_FLAGGED_STEPS_TOTAL)
        for kind in ("vanishing", "exploding"):  # pre-initialised for increase()
            flagged.add_metric([rank, kind], snap.gradient_flagged_steps.get(kind, 0))
        yield flagged

        spikes = family(names.SPIKES_TOTAL)
        last_spike = family(names.SPIKE_LAST_STEP)
        for kind in SPIKE_KINDS:  # pre-initialised for increase()
            count = snap.spikes.get(kind)
            spikes.add_metric([rank, kind], count.count if count is not None else 0)
            if count is not None and count.last is not None:
                last_spike.add_metric([rank, kind], count.last.step)
        yield spikes
        yield last_spike
        yield from _integrity(snap, rank)  # Config.sdc_check_interval_s
        yield from live  # hookprof_internal_errors_total
        yield _one(names.LAYERS, rank, len(snap.layers))
        yield _one(names.LAYERS_EXPORTED, rank, len(snap.exported_layers) + len(snap.timed_layers))

        if snap.first_nonfinite is not None and snap.first_nonfinite.layer is not None:
            first = family(names.FIRST_NONFINITE_INFO)
            named = snap.first_nonfinite
            first.add_metric([rank, named.layer, named.phase, str(named.step)], 1)
            yield first
        event = snap.first_nonfinite
        if event is not None and (event.found_by is not None or event.replay is not None):
            origin = family(names.FIRST_NONFINITE_ORIGIN_INFO)
            origin.add_metric(
                [
                    rank,
                    event.phase,
                    str(event.step),
                    event.found_by or "",
                    event.replay or "",
                    _HOST,
                    event.device,
                ],
                1,
            )
            yield origin
        if event is not None and event.capsule is not None:
            capsule = family(names.FIRST_NONFINITE_CAPSULE_INFO)
            capsule.add_metric([rank, str(event.step), event.capsule], 1)
            yield capsule

    def _layer_metrics(self, snap: Snapshot, rank: str) -> Iterator[Metric]:
        fwd = family(names.LAYER_FORWARD_SECONDS)
        bwd = family(names.LAYER_BACKWARD_SECONDS)
        recompute = family(names.LAYER_RECOMPUTE_SECONDS)
        grad = family(names.LAYER_GRADIENT_NORM)
        nonfinite = family(names.LAYER_NONFINITE_TOTAL)
        layer_flagged = family(names.LAYER_GRADIENT_FLAGGED_STEPS_TOTAL)
        detailed = len(snap.exported_layers)
        for k, name in enumerate(snap.exported_layers + snap.timed_layers):
            layer = snap.layers[name]
            if layer.forward_calls_total:
                _median(fwd, rank, name, layer.module, layer.forward_seconds_per_call_median)
                fwd.add_metric(
                    [rank, name, layer.module],
                    layer.forward_calls_total,
                    layer.forward_seconds_total,
                )
            if layer.backward_calls_total:
                _median(bwd, rank, name, layer.module, layer.backward_seconds_per_call_median)
                bwd.add_metric(
                    [rank, name, layer.module],
                    layer.backward_calls_total,
                    layer.backward_seconds_total,
                )
            if layer.recompute_calls_total:
                recompute.add_metric(
                    [rank, name, layer.module],
                    layer.recompute_calls_total,
                    layer.recompute_seconds_total,
                )
            if k >= detailed:  # on the page with its time alone (Config.detailed_layers)
                continue
            if layer.grad_norm is not None:
                grad.add_metric([rank, name], layer.grad_norm)
            for phase in LAYER_PHASES:
                count = layer.nonfinite.get(phase, 0)
                if count:
                    nonfinite.add_metric([rank, name, phase], count)
            for kind, count in layer.gradient_flags.items():
                if count:
                    layer_flagged.add_metric([rank, name, kind], count)
        yield from (fwd, bwd, recompute, grad, nonfinite, layer_flagged)
        # the per-layer statistics (step/statistics.py), hookprof's built-in ones (their
        # metrics declared in metrics_names) and the user's alike
        for stat_name, stat in snap.layer_statistics.items():
            metric = names.BY_NAME.get(names.LAYER_STATISTIC_PREFIX + stat_name)
            made = family(metric or names.layer_statistic(stat_name, stat.help))
            for name, value in stat.values.items():
                made.add_metric([rank, name], value)
            yield made


def _median(summary: Metric, rank: str, layer: str, module: str, value: float | None) -> None:
    """A layer timing summary's quantile="0.5": the median time per call over the rank's last
    sampled steps (publish/recent.py), what the layer straggler rule compares across ranks;
    absent until known."""
    if value is not None:
        summary.add_sample(
            summary.name, {"rank": rank, "layer": layer, "module": module, "quantile": "0.5"}, value
        )


def _integrity(snap: Snapshot, rank: str) -> Iterator[Metric]:
    """The silent-corruption checks' families (hookprof/integrity/; Config.sdc_check_interval_s):
    the replay check's results, the replicas' fingerprint and each rank's parameter watch."""
    for metric, counts in (
        (names.REPLAY_CHECKS_TOTAL, snap.replay_checks),  # (each result from 0 while on)
        (names.SPIKE_REPLAYS_TOTAL, snap.spike_replays),  # (the same, Config.spike_replay)
        (names.PARAMETER_WATCHES_TOTAL, snap.parameter_watches),
    ):
        if counts:
            made = family(metric)
            for result, steps in counts.items():
                made.add_metric([rank, result], steps)
            yield made
    for mismatch, info_metric, when_metric in (
        (snap.replay_mismatch, names.REPLAY_MISMATCH_INFO, names.REPLAY_MISMATCH_TIMESTAMP_SECONDS),
        (snap.spike_mismatch, names.SPIKE_MISMATCH_INFO, names.SPIKE_MISMATCH_TIMESTAMP_SECONDS),
    ):
        if mismatch is not None:
            info = family(info_metric)
            values = [rank, mismatch.layer, str(mismatch.step), str(mismatch.deterministic).lower()]
            if "phase" in info_metric.labels:  # (the spike replay's: it compares the backward)
                values.append(mismatch.phase)
            info.add_metric(values, 1)
            yield info
            yield _one(when_metric, rank, mismatch.time)
    if snap.parameter_fingerprint is not None:
        fp = snap.parameter_fingerprint
        for metric, value in (
            (names.PARAMETER_FINGERPRINT, fp.value),
            (names.PARAMETER_FINGERPRINT_STEP, fp.step),
        ):
            made = family(metric)
            made.add_metric([rank, fp.replica_group], value)
            yield made
    if snap.parameter_changes is not None:  # (counted from 0 while the check is on)
        yield _one(names.PARAMETER_CHANGES_OUTSIDE_UPDATE_TOTAL, rank, snap.parameter_changes)
    if snap.parameter_change is not None:
        change = snap.parameter_change
        info = family(names.PARAMETER_CHANGE_INFO)
        info.add_metric([rank, change.parameter, str(change.step), str(change.changed)], 1)
        yield info
        yield _one(names.PARAMETER_CHANGE_TIMESTAMP_SECONDS, rank, change.time)


def _one(metric: names.Metric, rank: str, value: float) -> Metric:
    """`metric`'s family holding its one series, labelled by rank."""
    made = family(metric)
    made.add_metric([rank], value)
    return made


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def make_registry(
    collector: Collector,
    *,
    process_metrics: bool = True,
    extra: tuple[Collector, ...] = (),
    registry: CollectorRegistry | None = None,
    registered: list[Collector] | None = None,
) -> CollectorRegistry:
    """A registry of its own per profiler, so two profilers never mix their series (or the
    one given, e.g. a caller's: `registered` then lists what was put in, to take out again)."""
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
    collectors = [collector, *extra]
    if process_metrics:
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...:
        # prometheus_client reads them from /proc; elsewhere psutil supplies the same names
        if has_proc_fs():
            from prometheus_client import ProcessCollector

            collectors.append(ProcessCollector(registry=None))
        else:
            collectors.append(PsutilProcessCollector())
    for c in collectors:
        registry.register(c)
    if registered is not None:
        registered.extend(collectors)
    return registry


def render(registry: Any) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(registry)
