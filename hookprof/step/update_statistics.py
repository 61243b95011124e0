"""Per-layer statistics of source "update": every layer's parameters around a measured
update, read in one pass over all layers (step/statistics.py has the interface).

A statistic of a layer's parameters with a per-layer `reduce` costs a few device ops per
layer; hookprof's own weight norm, update norm and update ratio are taken on sampled steps,
whose budget is per leaf, so they read the parameters the way the update measurement
already does (efficiency/updates.py): one fused pass per device over every parameter after
the update, and one over the copies taken before it, for the layers whose turn it is (a
rotation capped in bytes, at most once per `update_norm_interval_s`). A statistic of this
source declares `reduce_layers(view)` instead of `reduce`: `view` is an `AroundUpdate`, and
what it returns (a `LayerSums`, or a tuple of them) rides the step's one copy as per-device
vectors, added up and split per layer on the publisher's thread, where the statistic's
`fold` gets each layer's values as its one call:

    class UpdateToWeight:  # the built-in update ratio (step/builtin_statistics.py)
        name, help, source = "update_ratio", "...", "update"

        def reduce_layers(self, view):
            return view.update_squares(), view.weight_squares()

        def fold(self, calls):
            update, weight = calls[-1]
            return math.sqrt(update / weight) if weight != 0 else None

A layer's value is taken when its update is measured and kept until its next turn (one
that was not measured keeps its last value: its gauge does not blink out between turns).

Owns: `AroundUpdate`, `LayerSums`, `UpdateStatistics` (the taking at a measured step's
end). Used by: `StepEvents` (take), `pack_step` (the parts in the batch) and `Aggregator`
(folding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hookprof.step.statistics import SENDABLE, UPDATE, of_parameters


@dataclass(frozen=True, slots=True)
class LayerSums:
    """A sum per layer, as parts to add up: one float tensor per device, of one entry per
    layer of the table (layer i's sum at i, 0 where the device holds none of it), and the
    layers it has a value for."""

    parts: tuple[torch.Tensor, ...]
    layers: frozenset[int]


class AroundUpdate:
    """What a statistic of source "update" reads: every layer's parameters around one
    measured update, as sums per layer made once for all the statistics that ask."""

    def __init__(self, weights: LayerSums, updates: LayerSums) -> None:
        self._weights, self._updates = weights, updates

    def weight_squares(self) -> LayerSums:
        """The sum of squares of each layer's parameters after the update (this rank's part
        of a sharded one), for every layer that owns parameters."""
        return self._weights

    def update_squares(self) -> LayerSums:
        """The sum of squares of each layer's update (its parameters after the update minus
        before, exact: a copy was taken before), for the layers whose turn it was."""
        return self._updates


class Measured(Protocol):
    """The update measurement holding a step's copies (efficiency/updates.py UpdateNorms)."""

    def after_update(
        self,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], frozenset[int], frozenset[int]]: ...

    def drop(self) -> None: ...


# (statistic's index, the sums it returned, the layers that have a value of it)
Taken = tuple[int, tuple[LayerSums, ...], frozenset[int]]


class UpdateStatistics:
    """The statistics of source "update" of one profiler, taken at the end of a sampled step
    whose update was measured. One that raises, or returns anything but LayerSums, is
    reported and gives nothing that step (its layers keep their last values)."""

    def __init__(
        self,
        statistics: Sequence[Any],
        layers: Sequence[tuple[int, Any, Sequence[Any]]],
        report: Any = None,
    ):
        """(See statistics.of_parameters.)"""
        self._statistics = [
            (k, s, frozenset(i for i, _ in reach))
            for k, s, reach in of_parameters(statistics, UPDATE, layers, report)
        ]
        self._layers = len(layers)  # the length of each part of a LayerSums
        # the last step's sums around its update (the update's second run reads them for
        # the jump's gate: integrity/update_replay.py), taken by `last_around`
        self._around: AroundUpdate | None = None

    def __bool__(self) -> bool:
        return bool(self._statistics)

    def take(self, measured: Measured, report: Any) -> list[Taken]:
        """This step's values from `measured`, whose copies are freed; `report(part, exc)`
        hears of a statistic that failed."""
        weights, updates, updated, weighted = measured.after_update()
        view = AroundUpdate(LayerSums(tuple(weights), weighted), LayerSums(tuple(updates), updated))
        self._around = view
        taken: list[Taken] = []
        for k, stat, reach in self._statistics:
            try:
                result = stat.reduce_layers(view)
                sums = result if isinstance(result, tuple) else (result,)
                if not sums or not all(self._sendable(s) for s in sums):
                    raise TypeError(
                        f"layer statistic {stat.name!r}: reduce_layers() must return what the "
                        "view gives (LayerSums, or a tuple of them: one real 1-d tensor per "
                        f"device of {self._layers} values), got {result!r}"
                    )
            except Exception as exc:
                report(f"layer statistic {stat.name}", exc)
                continue
            taken.append((k, sums, reach.intersection(*(s.layers for s in sums))))
        return taken

    def last_around(self) -> AroundUpdate | None:
        """The sums around the update `take` read last (None: none since the last call)."""
        around, self._around = self._around, None
        return around

    def _sendable(self, sums: Any) -> bool:
        """What the step's copy can carry (a LayerSums a user built may hold anything): a
        part that it could not would lose the whole step's copy, not this statistic alone."""
        return isinstance(sums, LayerSums) and all(
            isinstance(part, torch.Tensor)
            and type(part) is torch.Tensor
            and part.dim() == 1
            and part.numel() == self._layers
            and part.dtype in SENDABLE
            and not part.is_meta
            and not part.requires_grad
            for part in sums.parts
        )
