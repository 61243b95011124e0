"""Per-layer statistics of sampled steps, as parts a user (or a new feature) writes alone.

A statistic is one small object: a name, a help text, and `reduce(output)`, which turns a
layer's output tensor into one 0-d tensor on the same device (a traceable tensor op: no
`.item()`, no Python branch on a value, so it never makes the host wait). hookprof calls it
on every floating output of every instrumented layer call of a sampled step with activation
statistics (the steps that take `hookprof_layer_activation_abs_max`), carries the results in
the step's one device-to-host copy, and exports the value of the layer's last call as the
gauge `hookprof_layer_<name>{rank, layer}`:

    class OutputMean:
        name = "activation_mean"
        help = "Mean of the layer's output at the last sampled step"

        def reduce(self, output: torch.Tensor) -> torch.Tensor:
            return output.float().mean()

    prof = hookprof.attach(model, layer_statistics=(OutputMean(),))

Nothing else is written: no change to the profiler, the record, the publisher or the
exporter (docs/architecture.md, "Adding to it").

A statistic of a layer's **parameters** says so with `source = "parameters"`; its `reduce`
gets the layer's own parameters (a tuple of detached tensors, in `named_parameters` order; of a
DTensor parameter, FSDP2's or tensor parallel's, this rank's local shard, so the value is the
rank's, as the gradient norms are) at each sampled step's end, after the update, for every
layer that owns parameters:

    class WeightRMS:
        name = "weight_rms"
        help = "Root mean square of the layer's parameters after the last sampled update"
        source = "parameters"

        def reduce(self, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
            squares = sum(p.float().pow(2).sum() for p in parameters)
            return (squares / sum(p.numel() for p in parameters)).sqrt()

(hookprof's own `hookprof_layer_weight_norm` is such a figure, taken with the update ratio
in one fused pass: docs/efficiency.md.)

Owns: the protocol and the checks of a statistic, and the taking of the parameter ones
(`ParameterStatistics`). Used by: `Profiler` (`checked`, at attach), `LayerHooks` (reduce of
the output ones), `StepEvents` (the parameter ones, at a sampled step's end), `pack_step`
(stacking), `Aggregator` (the last values) and `SnapshotCollector` (the gauge).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from hookprof.errors import ConfigError
from hookprof.metrics_names import BY_NAME, LAYER_STATISTIC_PREFIX

NAME = re.compile(r"[a-z][a-z0-9_]*")

# what a statistic reduces: each instrumented output of a layer (the default), or the layer's
# own parameters at a sampled step's end
OUTPUT, PARAMETERS = "output", "parameters"
SOURCES = (OUTPUT, PARAMETERS)


def source_of(statistic: Any) -> str:
    """What `statistic` reduces: its `source`, OUTPUT when it has none."""
    return getattr(statistic, "source", OUTPUT)


@runtime_checkable
class LayerStatistic(Protocol):
    """One per-layer statistic of sampled steps (see the module's docstring)."""

    name: str  # exported as hookprof_layer_<name>: lowercase, digits, underscores
    help: str  # the metric's HELP text
    # (optional) source: "output" (the default) or "parameters" (see the module's docstring)

    def reduce(self, output: Any) -> torch.Tensor:
        """A 0-d tensor on the device of what it reads (an output tensor, or a layer's
        parameters); never waits for the device."""
        ...


def checked(statistics: Any) -> tuple[LayerStatistic, ...]:
    """`statistics` if it is a tuple (or list) of well-formed statistics with names of their
    own; else ConfigError naming `layer_statistics` and what is wrong."""
    if isinstance(statistics, list):
        statistics = tuple(statistics)
    if not isinstance(statistics, tuple):
        raise ConfigError("layer_statistics", statistics, "a tuple of layer statistics")
    seen: set[str] = set()
    for stat in statistics:
        if not isinstance(stat, LayerStatistic) or not callable(stat.reduce):
            raise ConfigError(
                "layer_statistics", stat, "objects with name, help and reduce(output)"
            )
        if not isinstance(stat.name, str) or not NAME.fullmatch(stat.name):
            raise ConfigError(
                "layer_statistics", stat.name, "names of lowercase letters, digits and underscores"
            )
        if LAYER_STATISTIC_PREFIX + stat.name in BY_NAME or stat.name in seen:
            raise ConfigError(
                "layer_statistics",
                stat.name,
                "a name neither given twice nor one of hookprof's own metrics",
            )
        if not isinstance(stat.help, str) or not stat.help.strip():
            raise ConfigError("layer_statistics", stat.help, f"a help text for {stat.name!r}")
        if source_of(stat) not in SOURCES:
            raise ConfigError(
                "layer_statistics",
                source_of(stat),
                f"a source of {stat.name!r} among {', '.join(map(repr, SOURCES))}",
            )
        seen.add(stat.name)
    return statistics


def one_value(statistic: Any, value: Any) -> torch.Tensor:
    """`value`, a statistic's result, as the 0-d float32 that is sent; TypeError naming the
    statistic when it is not a one-value tensor."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"layer statistic {statistic.name!r}: reduce() must return a "
            f"one-value tensor, got {type(value).__qualname__}"
        )
    if hasattr(value, "to_local"):  # a DTensor: it cannot ride the step's copy of plain ones
        raise TypeError(
            f"layer statistic {statistic.name!r}: reduce() returned a DTensor; reduce this "
            "rank's local tensor (dtensor.to_local()) and return a plain one"
        )
    return value.detach().reshape(()).to(torch.float32)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a statistic reads it: detached, and a DTensor's (FSDP2, tensor
    parallel) local shard, so that its value is this rank's, as the gradient norms are."""
    param = param.detach()
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class ParameterStatistics:
    """The statistics whose source is a layer's parameters (`source = "parameters"`), taken
    at each sampled step's end, after the update: `take()` reduces every layer that owns
    parameters and returns (statistic, layer, 0-d value on the device) to be sent with the
    step. A statistic that fails is reported and skipped for the rest of that step; the
    others, and every other figure, go on."""

    def __init__(self, statistics: Sequence[Any], layers: Sequence[tuple[int, Sequence[Any]]]):
        """`statistics`: all of a profiler's (their position is their index everywhere);
        `layers`: (layer index, its own parameters) of each layer that owns any."""
        self._statistics = [(k, s) for k, s in enumerate(statistics) if source_of(s) == PARAMETERS]
        self._layers = [(index, tuple(params)) for index, params in layers if params]

    def __bool__(self) -> bool:
        return bool(self._statistics)

    def take(self, report: Any) -> list[tuple[int, int, torch.Tensor]]:
        """This step's values; `report(part, exc)` hears of a statistic that failed."""
        taken: list[tuple[int, int, torch.Tensor]] = []
        for k, stat in self._statistics:
            try:
                values = [
                    (k, index, one_value(stat, stat.reduce(tuple(map(_local, params)))))
                    for index, params in self._layers
                ]
            except Exception as exc:
                report(f"layer statistic {stat.name}", exc)
                continue
            taken.extend(values)
        return taken
