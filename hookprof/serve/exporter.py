"""Prometheus exposition: a custom Collector that renders the latest Snapshot, and the
per-profiler registry (the HTTP server is hookprof/server.py). Names, types and labels are
the metric contract in DESIGN.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from hookprof._version import __version__
from hookprof.efficiency.families import efficiency_families
from hookprof.faults import log
from hookprof.phases.families import progress_families
from hookprof.snapshot import LAYER_PHASES, PHASES, Snapshot
from hookprof.serve.system import PsutilProcessCollector, has_proc_fs


class SnapshotCollector(Collector):
    """Builds metric families from `get_snapshot()` at scrape time. Never touches the device
    or the hooks; reads one immutable object. With `model`, every series it makes carries
    that `model` label (several models share a process's endpoint); `build_info` False
    leaves hookprof_build_info to the endpoint, which serves it once."""

    def __init__(self, get_snapshot: Callable[[], Snapshot], torch_version: str,
                 publisher_alive: Callable[[], bool] = lambda: True, rank: int = 0,
                 model: str | None = None, build_info: bool = True):
        self._get_snapshot = get_snapshot
        self._torch_version = torch_version
        self._publisher_alive = publisher_alive
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
        for family in self._families():
            if family.name != "hookprof_build_info":
                family.samples = [s._replace(labels={**s.labels, "model": self._model})
                                  for s in family.samples]
            yield family

    def _families(self) -> Iterator[Metric]:
        rank = self._rank
        try:
            snap = self._get_snapshot()
            rank = str(snap.rank)
            # built whole before the first yield: a failure leaves no half-rendered page
            families = [*self._step_metrics(snap, rank), *self._layer_metrics(snap, rank),
                        *progress_families(snap, rank), *efficiency_families(snap, rank)]
        except Exception:  # a scrape must not fail: the thread gauge and build info still go out
            families = []
            if not self._failed:
                self._failed = True
                log.error("hookprof: rendering the snapshot failed; serving the rest", exc_info=True)
        yield from families

        # read at scrape time, not from the snapshot: a dead publisher publishes nothing
        up = GaugeMetricFamily(
            "hookprof_publisher_thread_up",
            "1 while the background thread that folds sampled steps into snapshots is alive",
            labels=["rank"],
        )
        up.add_metric([rank], 1.0 if self._publisher_alive() else 0.0)
        yield up

        if not self._build_info:
            return
        build = GaugeMetricFamily(
            "hookprof_build_info",
            "hookprof and torch versions",
            labels=["version", "torch_version"],
        )
        build.add_metric([__version__, self._torch_version], 1)
        yield build

    def _step_metrics(self, snap: Snapshot, rank: str) -> Iterator[Metric]:
        steps = CounterMetricFamily("hookprof_steps", "Training steps completed", labels=["rank"])
        steps.add_metric([rank], snap.step)
        yield steps

        sampled = CounterMetricFamily(
            "hookprof_sampled_steps", "Steps with per-layer hooks installed", labels=["rank"]
        )
        sampled.add_metric([rank], snap.sampled_steps)
        yield sampled

        duration = HistogramMetricFamily(
            "hookprof_step_duration_seconds",
            "Wall time between step boundaries (optimizer steps or Profiler.step calls)",
            labels=["rank"],
        )
        buckets = [(_le(b), c) for b, c in snap.step_duration_buckets] or [("+Inf", 0)]
        duration.add_metric([rank], buckets, snap.step_duration_sum)
        yield duration

        if snap.last_step_timestamp is not None:
            last = GaugeMetricFamily(
                "hookprof_last_step_timestamp_seconds",
                "Unix time at which the last step ended",
                labels=["rank"],
            )
            last.add_metric([rank], snap.last_step_timestamp)
            yield last

        if snap.loss is not None:
            loss = GaugeMetricFamily(
                "hookprof_loss", "Loss at the last sampled step", labels=["rank"]
            )
            loss.add_metric([rank], snap.loss)
            yield loss

        if snap.grad_norm is not None:
            norm = GaugeMetricFamily(
                "hookprof_gradient_norm",
                "Global L2 norm of all gradients at the last sampled step",
                labels=["rank"],
            )
            norm.add_metric([rank], snap.grad_norm)
            yield norm

        nonfinite = CounterMetricFamily(
            "hookprof_nonfinite_steps",
            "Steps on which a NaN or Inf was seen, by phase (forward outputs, gradients, loss)",
            labels=["rank", "phase"],
        )
        for phase in PHASES:  # pre-initialised to 0 so that increase() sees the first one
            nonfinite.add_metric([rank, phase], snap.nonfinite_steps.get(phase, 0))
        yield nonfinite

        skipped = CounterMetricFamily(
            "hookprof_skipped_steps",
            "Steps whose optimizer update the GradScaler skipped",
            labels=["rank"],
        )
        skipped.add_metric([rank], snap.skipped_steps)
        yield skipped

        held = CounterMetricFamily(
            "hookprof_held_back_updates",
            "Optimizer updates of non-finite steps that hookprof held back "
            '(on_nonfinite="skip" or "raise")',
            labels=["rank"],
        )
        held.add_metric([rank], snap.held_back_updates)
        yield held

        flagged = CounterMetricFamily(
            "hookprof_gradient_flagged_steps",
            "Sampled steps on which some layer's gradient norm was vanishing (below "
            "Config.vanishing_grad_norm) or exploding (above Config.exploding_grad_norm)",
            labels=["rank", "kind"],
        )
        for kind in ("vanishing", "exploding"):  # pre-initialised for increase()
            flagged.add_metric([rank, kind], snap.gradient_flagged_steps.get(kind, 0))
        yield flagged

        errors = CounterMetricFamily(
            "hookprof_internal_errors",
            "Internal hookprof errors (each switches per-layer instrumentation off)",
            labels=["rank"],
        )
        errors.add_metric([rank], snap.internal_errors)
        yield errors

        layers = GaugeMetricFamily("hookprof_layers", "Instrumented layers", labels=["rank"])
        layers.add_metric([rank], len(snap.layers))
        yield layers
        exported = GaugeMetricFamily(
            "hookprof_layers_exported",
            "Layers with per-layer series in this exposition (Config.max_layers)",
            labels=["rank"],
        )
        exported.add_metric([rank], len(snap.exported_layers))
        yield exported

        if snap.first_nonfinite is not None and snap.first_nonfinite.layer is not None:
            first = GaugeMetricFamily(
                "hookprof_first_nonfinite_info",
                "The first NaN or Inf seen in this run: layer, phase and step",
                labels=["rank", "layer", "phase", "step"],
            )
            event = snap.first_nonfinite
            first.add_metric([rank, event.layer, event.phase, str(event.step)], 1)
            yield first

    def _layer_metrics(self, snap: Snapshot, rank: str) -> Iterator[Metric]:
        fwd = SummaryMetricFamily(
            "hookprof_layer_forward_seconds",
            "Forward time per call on sampled steps, excluding instrumented submodules",
            labels=["rank", "layer", "module"],
        )
        bwd = SummaryMetricFamily(
            "hookprof_layer_backward_seconds",
            "Backward time per call on sampled steps, excluding instrumented submodules",
            labels=["rank", "layer", "module"],
        )
        recompute = SummaryMetricFamily(
            "hookprof_layer_recompute_seconds",
            "Forward recomputation during backward (activation checkpointing) per call on "
            "sampled steps; only layers that were recomputed. Not part of forward seconds",
            labels=["rank", "layer", "module"],
        )
        grad = GaugeMetricFamily(
            "hookprof_layer_gradient_norm",
            "L2 norm of the layer's own parameters' gradients at the last sampled step",
            labels=["rank", "layer"],
        )
        nonfinite = CounterMetricFamily(
            "hookprof_layer_nonfinite",
            "Sampled steps on which the layer's outputs (forward) or gradients (backward) "
            "held a NaN or Inf; only layers that ever did",
            labels=["rank", "layer", "phase"],
        )
        layer_flagged = CounterMetricFamily(
            "hookprof_layer_gradient_flagged_steps",
            "Sampled steps on which the layer's gradient norm was vanishing or exploding; "
            "only layers that ever were",
            labels=["rank", "layer", "kind"],
        )
        zero = GaugeMetricFamily(
            "hookprof_layer_activation_zero_ratio",
            "Fraction of exact zeros in the layer's outputs at the last sampled step",
            labels=["rank", "layer"],
        )
        absmax = GaugeMetricFamily(
            "hookprof_layer_activation_abs_max",
            "Largest absolute value in the layer's outputs at the last sampled step",
            labels=["rank", "layer"],
        )
        for name in snap.exported_layers:
            layer = snap.layers[name]
            if layer.forward_calls_total:
                fwd.add_metric(
                    [rank, name, layer.module],
                    layer.forward_calls_total,
                    layer.forward_seconds_total,
                )
            if layer.backward_calls_total:
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
            if layer.grad_norm is not None:
                grad.add_metric([rank, name], layer.grad_norm)
            for phase in LAYER_PHASES:
                count = layer.nonfinite.get(phase, 0)
                if count:
                    nonfinite.add_metric([rank, name, phase], count)
            for kind, count in layer.gradient_flags.items():
                if count:
                    layer_flagged.add_metric([rank, name, kind], count)
            if layer.activation_zero_ratio is not None:
                zero.add_metric([rank, name], layer.activation_zero_ratio)
            if layer.activation_abs_max is not None:
                absmax.add_metric([rank, name], layer.activation_abs_max)
        yield from (fwd, bwd, recompute, grad, nonfinite, layer_flagged, zero, absmax)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def make_registry(collector: Collector, *, process_metrics: bool = True,
                  extra: tuple[Collector, ...] = (),
                  registry: CollectorRegistry | None = None,
                  registered: list[Collector] | None = None) -> CollectorRegistry:
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
