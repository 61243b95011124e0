"""Which modules hookprof instruments, and which layer owns each parameter."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

ROOT_NAME = "(root)"  # the qualified name of the root module is "", which reads badly in a label
INPUT_NAME = "(input)"  # the producer of a NaN/Inf already in the root module's inputs


@dataclass(frozen=True, slots=True)
class Layer:
    index: int
    name: str  # qualified name from named_modules()
    module_type: str  # class name, the `module` label
    # held weakly: a profiler must not keep its model alive (a notebook cell run again
    # drops the model, and the next attach releases the profiler whose model is gone)
    module_ref: weakref.ref[nn.Module]
    param_indices: tuple[int, ...]  # positions in LayerTable.params

    @property
    def module(self) -> nn.Module | None:
        """The module, or None once it has been garbage-collected."""
        return self.module_ref()


class LayerTable:
    """The instrumented modules of a model, in `named_modules()` order.

    A module is a layer when it is a leaf (no children) or owns parameters directly:
    `nn.MultiheadAttention` owns `in_proj_weight` and uses `out_proj.weight` without calling
    `out_proj`, so both are layers and every parameter belongs to exactly one of them (the
    first module that lists it, so tied weights count once).
    """

    def __init__(self, model: nn.Module):
        self.layers: list[Layer] = []
        self.params: list[nn.Parameter] = []
        self.param_names: list[str] = []
        self.param_layer: list[int] = []  # layer index of each parameter
        # the other modules (non-leaf, no parameters of their own, the root among them):
        # (name, module); their own code can make a NaN between their children's calls
        self._containers: list[tuple[str, weakref.ref[nn.Module]]] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            own = [
                (pname, p)
                for pname, p in module._parameters.items()
                if p is not None and id(p) not in seen
            ]
            is_leaf = next(iter(module.children()), None) is None
            if not (is_leaf or own):
                self._containers.append((name or ROOT_NAME, weakref.ref(module)))
                continue
            index = len(self.layers)
            first = len(self.params)
            for pname, p in own:
                seen.add(id(p))
                self.params.append(p)
                self.param_names.append(f"{name}.{pname}" if name else pname)
                self.param_layer.append(index)
            self.layers.append(
                Layer(
                    index=index,
                    name=name or ROOT_NAME,
                    module_type=type(module).__name__,
                    module_ref=weakref.ref(module),
                    param_indices=tuple(range(first, len(self.params))),
                )
            )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def containers(self) -> list[tuple[str, nn.Module | None]]:
        """(name, module) of the other modules; the module is None once collected."""
        return [(name, ref()) for name, ref in self._containers]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    # rows: the layers, then the containers. A recorded call is numbered by its row: the
    # replay hooks containers too, and a container compiled on its own (regional
    # compilation) is timed as one call (compiled.compiled_regions)

    @property
    def rows(self) -> int:
        return len(self.layers) + len(self._containers)

    def row_name(self, row: int) -> str:
        if row < len(self.layers):
            return self.layers[row].name
        return self._containers[row - len(self.layers)][0]

    def row_module(self, row: int) -> nn.Module | None:
        """The row's module, or None once it has been garbage-collected."""
        if row < len(self.layers):
            return self.layers[row].module
        return self._containers[row - len(self.layers)][1]()

    def named_rows(self) -> Iterator[tuple[int, str, nn.Module | None]]:
        """(row, name, module) of every row: the layers, then the containers."""
        for layer in self.layers:
            yield layer.index, layer.name, layer.module
        first = len(self.layers)
        for k, (name, ref) in enumerate(self._containers):
            yield first + k, name, ref()

    @property
    def row_of(self) -> dict[int, tuple[int, str]]:
        """id(module) -> (row, name), for the modules alive."""
        return {id(m): (row, name) for row, name, m in self.named_rows() if m is not None}

    @property
    def has_dtensor_params(self) -> bool:
        """FSDP2 or tensor parallel: parameters (and so gradients) are DTensor shards."""
        return any(type(p).__name__ == "DTensor" for p in self.params)

    def param_devices(self) -> set[torch.device]:
        return {p.device for p in self.params}
