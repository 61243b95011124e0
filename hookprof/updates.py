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

import torch

from .gradients import layer_squares, local_tensor
from .layers import LayerTable


class UpdateNorms:
    def __init__(self, table: LayerTable, max_bytes: int):
        self._table = table
        self._max_bytes = max_bytes
        # layers with trainable parameters, and the bytes of this rank's part of them
        self._trainable = [layer.index for layer in table.layers
                           if any(table.params[i].requires_grad for i in layer.param_indices)]
        self._bytes = {i: sum(local_tensor(p.detach()).numel() * p.element_size()
                              for p in (table.params[j] for j in table.layers[i].param_indices)
                              if p.requires_grad)
                       for i in self._trainable}
        self._next = 0  # position in _trainable of the next layer whose turn it is
        self._before: list[tuple[int, torch.Tensor]] | None = None  # (param index, copy)
        self._index_cache: dict = {}

    @property
    def taken(self) -> bool:
        """Copies of this step's turn are held (taken at its first optimizer pre-hook)."""
        return self._before is not None

    @property
    def largest_layer_bytes(self) -> int:
        return max(self._bytes.values(), default=0)

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
        chosen, total = [], 0
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

    def after_update(self) -> tuple[list[torch.Tensor], list[torch.Tensor], frozenset[int], frozenset[int]]:
        """At the step's end: per device, squared weight norms per layer (every layer) and
        squared update norms per layer (the layers copied); which layers were copied, and
        which have parameters. The copies are freed."""
        before, self._before = self._before, None
        weights: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        with torch.no_grad():
            for p, layer in zip(self._table.params, self._table.param_layer):
                w = local_tensor(p.detach())
                tensors, layers = weights.setdefault(w.device, ([], []))
                tensors.append(w)
                layers.append(layer)
            updates: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
            for i, copy in before or ():
                copy.sub_(local_tensor(self._table.params[i].detach()))  # before - after: -update
                tensors, layers = updates.setdefault(copy.device, ([], []))
                tensors.append(copy)
                layers.append(self._table.param_layer[i])
        n = len(self._table)
        weight_parts, weighted = layer_squares(weights, n, self._index_cache)
        update_parts, updated = layer_squares(updates, n, self._index_cache)
        return weight_parts, update_parts, updated, weighted

    def drop(self) -> None:
        """No update to measure (a skipped step, a step whose hooks failed, detach)."""
        self._before = None
