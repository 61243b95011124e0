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
exporter (docs/architecture.md, "Adding a per-layer statistic").

Owns: the protocol and the checks of a statistic. Used by: `Profiler` (`checked`, at attach),
`LayerHooks` (reduce), `pack_step` (stacking), `Aggregator` (the last values) and
`SnapshotCollector` (the gauge).
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

import torch

from hookprof.errors import ConfigError
from hookprof.metrics_names import BY_NAME, LAYER_STATISTIC_PREFIX

NAME = re.compile(r"[a-z][a-z0-9_]*")


@runtime_checkable
class LayerStatistic(Protocol):
    """One per-layer statistic of sampled steps (see the module's docstring)."""

    name: str  # exported as hookprof_layer_<name>: lowercase, digits, underscores
    help: str  # the metric's HELP text

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        """A 0-d tensor on `output`'s device; never waits for the device."""
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
        seen.add(stat.name)
    return statistics
