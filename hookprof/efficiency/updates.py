"""Weight norms and update norms per layer on sampled steps, on the device.

The update is the change the optimizer step makes to a parameter: its value after the step
minus its value before. The "before" needs a copy (an optimizer may do anything: Adam's
update is not a function of the gradient alone), and a copy of every parameter would double
the model's memory. So the copy is capped: on each sampled step the layers copied are the
next ones in turn whose parameters fit in `max_bytes` together (a rotation: with a cap of
a quarter of the model, each layer is measured every fourth sampled step). A layer larger
than the cap alone is copied alone on its turn, so the memory held is at most
max(max_bytes, the largest layer). Copies are taken at the first pre-hook of an optimizer
owning the model's parameters and freed at the step's end: between them the device holds
them, nothing more.

Why not something cheaper: ||after - before||^2 = ||after||^2 - 2<after, before> +
||before||^2 still needs `before` at the time of the inner product, and for an update a
thousand times smaller than the weight that difference of large numbers loses the update to
rounding. Random projections (sketches) of before and after need no copy but are
approximate and cost a pass per projection; a low-precision copy loses the update the same
way. The rotation is exact, bounded and cheap: each layer's update norm is exact on the
steps it is measured.

Weight norms of every layer (after the update) are read on every step that measures updates: a read of
every parameter, no copy. Nothing here reads a value back: the per-layer squares ride the
step's one device-to-host copy.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from hookprof.device.transfer import index_to_device
from hookprof.layers import LayerTable
from hookprof.step.gradients import layer_squares, local_tensor

_UNGROUPED = object()  # no optimizer followed yet


class UpdateNorms:
    def __init__(self, table: LayerTable, max_bytes: int):
        self._table = table
        self._max_bytes = max_bytes
        self._next = 0  # position in _trainable of the next layer whose turn it is
        self._before: list[tuple[int, torch.Tensor]] | None = None  # (param index, copy)
        self._index_cache: dict = {}
        self._trainable: list[int] = []  # layers with trainable parameters (_group)
        self._groups_key: Any = _UNGROUPED  # the optimizer's parameter groups at the last _group
        self._group()

    def _group(self) -> None:
        """What a measurement reads, worked out once and again only when the optimizer's
        parameter groups change (a group added mid-run, with layers unfrozen for it): the
        layers with trainable parameters and the bytes of this rank's part of them, and the
        parameters by device with their layers' indices (what layer_squares reduces)."""
        table = self._table
        trainable = [
            layer.index
            for layer in table.layers
            if any(table.params[i].requires_grad for i in layer.param_indices)
        ]
        # the rotation goes on from the layer whose turn it was
        was = self._trainable[self._next] if self._trainable else 0
        self._next = bisect.bisect_left(trainable, was) % len(trainable) if trainable else 0
        self._trainable = trainable
        self._bytes = {
            i: sum(
                local_tensor(p.detach()).numel() * p.element_size()
                for p in (table.params[j] for j in table.layers[i].param_indices)
                if p.requires_grad
            )
            for i in trainable
        }
        by_device: dict[torch.device, tuple[list[int], list[int]]] = {}
        for i, (p, layer) in enumerate(zip(table.params, table.param_layer)):
            params, layers = by_device.setdefault(local_tensor(p.detach()).device, ([], []))
            params.append(i)
            layers.append(layer)
        # (device, parameter indices, their layers, those layers on the device once used)
        self._weights: list[tuple[torch.device, list[int], list[int], list[torch.Tensor]]] = [
            (device, params, layers, []) for device, (params, layers) in by_device.items()
        ]

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer` is about to update: regroup if its parameter groups changed since
        the last measurement (their number, or a group's list of parameters)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        if key != self._groups_key:
            if self._groups_key is not _UNGROUPED:
                self._group()
            self._groups_key = key

    @property
    def taken(self) -> bool:
        """Copies of this step's turn are held (taken at its first optimizer pre-hook)."""
        return self._before is not None

    @property
    def turn(self) -> tuple[int, ...]:
        """The positions of the parameters copied for this step's turn."""
        return tuple(i for i, _ in self._before or ())

    def before_update(self) -> None:
        """The parameters are about to change (the first owned optimizer's pre-hook of a
        sampled step): copy the layers whose turn it is."""
        if self._before is not None or not self._trainable:
            return
        before = []
        with torch.no_grad():
            for layer in self._turn():
                for i in self._table.layers[layer].param_indices:
                    p = self._table.params[i]
                    if p.requires_grad:
                        before.append((i, local_tensor(p.detach()).clone()))
        self._before = before

    def _turn(self) -> list[int]:
        chosen: list[int] = []
        total = 0
        n = len(self._trainable)
        while len(chosen) < n:
            layer = self._trainable[self._next]
            size = self._bytes[layer]
            if chosen and total + size > self._max_bytes:
                break
            chosen.append(layer)
            total += size
            self._next = (self._next + 1) % n
        return chosen

    def after_update(
        self,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], frozenset[int], frozenset[int]]:
        """At the step's end: per device, squared weight norms per layer (every layer) and
        squared update norms per layer (the layers copied); which layers were copied, and
        which have parameters. The copies are freed."""
        before, self._before = self._before, None
        params = self._table.params
        with torch.no_grad():
            weights = self._weight_tensors()
            if weights is None:
                self._group()  # the model moved (.to()) since the grouping: once per move
                weights = self._weight_tensors() or {}
            updates: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
            for i, copy in before or ():
                copy.sub_(local_tensor(params[i].detach()))  # before - after: -update
                tensors, layers = updates.setdefault(copy.device, ([], []))
                tensors.append(copy)
                layers.append(self._table.param_layer[i])
        n = len(self._table)
        weight_parts, weighted = layer_squares(weights, n, self._weight_index)
        update_parts, updated = layer_squares(updates, n, self._index_cache)
        return weight_parts, update_parts, updated, weighted

    def _weight_index(self, device: torch.device, layers: list[int]) -> torch.Tensor:
        for d, _, grouped, index in self._weights:
            if d == device:
                if not index:  # made at the first measurement on this device, kept
                    index.append(index_to_device(grouped, device))
                return index[0]
        raise KeyError(device)

    def _weight_tensors(self) -> dict[torch.device, tuple[list[torch.Tensor], list[int]]] | None:
        """This rank's part of every parameter, by device as grouped; None when any of them
        is no longer on its group's device (a model moved, or one stage of it moved)."""
        params = self._table.params
        weights = {}
        for device, group, layers, _ in self._weights:
            tensors = [local_tensor(params[i].detach()) for i in group]
            if any(t.device != device for t in tensors):
                return None
            weights[device] = (tensors, layers)
        return weights

    def drop(self) -> None:
        """No update to measure (a skipped step, a step whose hooks failed, detach)."""
        self._before = None
