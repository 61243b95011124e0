"""hookprof's own per-layer statistics, of outputs and of the parameters around an update,
written as parts of the interface a user's statistic uses (step/statistics.py,
step/update_statistics.py) and registered like one: the profiler gives LayerHooks, the
parameter statistics, the aggregator and the exporter `BUILT_IN + the user's` (those of
source "update" only with Config.update_norms). Beyond that, LayerHooks skips its check of a
result for these (`values_of`: theirs are 0-d tensors and floats), and the aggregator copies
their values into LayerStats and LayerEfficiency by name for the readers (`top`, the
report), and the update ratio's (update², weight²) into the model-wide update ratio and the
update ratio jump judge (efficiency/figures.py).

Adding one is a class here (its `name` is its metric's, `hookprof_layer_<name>`, declared in
metrics_names.py for its type and help), the metric's row in docs/metrics.md, and the class
in BUILT_IN.

Owns: the built-in statistics. Used by: `Profiler` (registration), `LayerHooks` (which
results need no check), `Aggregator` (their values as LayerStats and LayerEfficiency fields,
by name; the update ratio's for the model's).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hookprof import metrics_names as names
from hookprof.errors import ConfigError
from hookprof.step.statistics import EXTREMES, UPDATE, checked, source_of
from hookprof.step.update_statistics import AroundUpdate, LayerSums

ZERO_SAMPLE = 4096  # values per output the zero ratio is computed from


def zero_sample(d: torch.Tensor) -> torch.Tensor:
    """At most ZERO_SAMPLE evenly spaced values of `d` (a view: nothing is copied)."""
    flat = d.reshape(-1)
    stride = -(-flat.numel() // ZERO_SAMPLE)  # ceil division
    return flat[::stride] if stride > 1 else flat


def _short(metric: names.Metric) -> str:
    return metric.name.removeprefix(names.LAYER_STATISTIC_PREFIX)


class ActivationAbsMax:
    """max |x| over the layer's outputs in the step, from the non-finite check's own min and
    max of each output (source "extremes": no work of its own on the device or in the
    hooks), folded on the host. NaN wins, as in torch.amax: a layer whose output held one
    shows NaN."""

    name = _short(names.LAYER_ACTIVATION_ABS_MAX)
    help = names.LAYER_ACTIVATION_ABS_MAX.help
    source = EXTREMES

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        out = -math.inf
        for low, high in calls:
            for v in (-low, high):
                if v != v:
                    return v
                out = max(out, v)
        return out


class ActivationZeroRatio:
    """The share of exact zeros in the layer's outputs (dead units), counted on an evenly
    strided sample of at most ZERO_SAMPLE values per output (exact counts cost ~10x more),
    over all the step's calls. Only for layers without parameters of their own (ReLU, GELU,
    Dropout, pooling): a Linear or Conv output is almost never exactly zero."""

    name = _short(names.LAYER_ACTIVATION_ZERO_RATIO)
    help = names.LAYER_ACTIVATION_ZERO_RATIO.help

    def applies_to(self, module: nn.Module) -> bool:
        return next(module.parameters(recurse=False), None) is None

    def reduce(self, output: torch.Tensor) -> tuple[torch.Tensor, float]:
        sample = zero_sample(output)
        return torch.count_nonzero(sample), float(sample.numel())

    def fold(self, calls: list[tuple[float, ...]]) -> float | None:
        values = sum(n for _, n in calls)
        return (values - sum(nonzero for nonzero, _ in calls)) / values if values else None


class WeightNorm:
    """The L2 norm of the layer's parameters after the update, on the steps whose update is
    measured (every layer that owns parameters, frozen ones too)."""

    name = _short(names.LAYER_WEIGHT_NORM)
    help = names.LAYER_WEIGHT_NORM.help
    source = UPDATE

    def reduce_layers(self, view: AroundUpdate) -> LayerSums:
        return view.weight_squares()

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        return math.sqrt(calls[-1][0])


class UpdateNorm:
    """The L2 norm of the layer's update (after - before) on its turn, kept between turns."""

    name = _short(names.LAYER_UPDATE_NORM)
    help = names.LAYER_UPDATE_NORM.help
    source = UPDATE

    def reduce_layers(self, view: AroundUpdate) -> LayerSums:
        return view.update_squares()

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        return math.sqrt(calls[-1][0])


class UpdateRatio:
    """update norm / weight norm of the same step, on the layer's turn. Its (update², weight²)
    also make the model-wide ratio and feed the update ratio jump judge (the aggregator).
    NaN weights (a NaN update was applied) give a NaN ratio, exported as such; zero weights
    none."""

    name = _short(names.LAYER_UPDATE_RATIO)
    help = names.LAYER_UPDATE_RATIO.help
    source = UPDATE

    def reduce_layers(self, view: AroundUpdate) -> tuple[LayerSums, LayerSums]:
        return view.update_squares(), view.weight_squares()

    def fold(self, calls: list[tuple[float, ...]]) -> float | None:
        update, weight = calls[-1]
        return math.sqrt(update / weight) if weight != 0 else None


BUILT_IN: tuple[Any, ...] = (
    ActivationAbsMax(),
    ActivationZeroRatio(),
    WeightNorm(),
    UpdateNorm(),
    UpdateRatio(),
)
ABS_MAX, ZERO_RATIO, WEIGHT_NORM, UPDATE_NORM, UPDATE_RATIO = (s.name for s in BUILT_IN)


def registered(users: Any, *, update_norms: bool) -> tuple[Any, ...]:
    """A profiler's statistics: the built-in ones (those of the update measurement only with
    it, Config.update_norms), then the user's, checked (ConfigError naming
    `layer_statistics`: a user's of source "update" without the measurement would never
    run)."""
    built_in = tuple(s for s in BUILT_IN if update_norms or source_of(s) != UPDATE)
    statistics = checked(built_in, own=True) + checked(users)
    for stat in statistics[len(built_in) :]:
        if source_of(stat) == UPDATE and not update_norms:
            raise ConfigError(
                "layer_statistics",
                stat.name,
                "statistics of source 'update' only with update_norms=True",
            )
    return statistics
