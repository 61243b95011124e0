"""Every layer's output bits summed, on the device, while a caller collects them: the spike
replay's per-layer checksums (Config.spike_replay, integrity/spike_replay.py, issue 43 item 3).

A spike is known to be one only after its step (publish/spikes.py), so the sums that would say
where a wrong value entered its forward must be taken on every step while the replay is armed:
the step's first training forward (`collect(into)`), then, on a step that is replayed, the
replay's (`collect(again)`), compared pairwise in call order.

Each layer's `forward` gets a ForwardWrapper (step/hooks.py) for as long as the replay is
armed (attach to detach), under the sampled steps' own, which go in and out over it; a layer
with forward hooks of its own (one may replace its output, which the rest of the model then
sees) gets a forward hook after them instead, as the sampled steps' hooks do. While
nothing is collected a call costs the wrapper's frame and one attribute read; while collecting,
the bits of each floating-point output are summed as integers (tensors.output_checksum: a view and
one reduction, kept on the device). Only the collecting thread's calls count (another thread
training another model through a shared layer is not this step's).

With `grads` (a GradientSums), each summed output that needs a gradient also gets a tensor
hook for the collection: when the backward computes that output's gradient, its bits are
summed the same way, in the order the backward computes them. The gradient of a layer's
output is what the backward of the layers that take that output made: the spike replay's
backward comparison (integrity/spike_replay.py). The hook only reads the gradient (it returns
nothing), and goes with the graph.

A fault here (an output whose bits cannot be read) stops the collection and is counted; the
layer's forward and its output are untouched (a gradient hook's fault marks its collection
broken, and the backward goes on). Copies of the model (EMA, torch.save) carry no wrapper
(step/copies.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from hookprof.compiled import is_compiling
from hookprof.faults import Faults
from hookprof.handles import HandleGroup, Removable
from hookprof.layers import LayerTable
from hookprof.step.hooks import wrap_attribute
from hookprof.tensors import iter_tensors, output_checksum, summable

# torch >= 2.2; None: a replay's backward is not run (integrity/spike_replay.py says why)
get_gradient_edge: Any = getattr(torch.autograd.graph, "get_gradient_edge", None)

# layer calls kept per collection: a forward that never returns (it raised) followed by an
# evaluation loop on the same thread would otherwise grow the list until the next step
MAX_CALLS = 1 << 16

_Tensor = torch.Tensor


class GradientSums:
    """One collection's output gradients, summed as the backward computes them: (layer, sum)
    in that order; `broken`: one could not be read, or more than MAX_CALLS came (not whole);
    `placed`: the hooks placed (more sums than hooks: more than one backward ran through the
    outputs, retain_graph)."""

    __slots__ = ("items", "broken", "placed", "edges", "__weakref__")

    def __init__(self, edges: bool = False) -> None:
        self.items: list[tuple[int, torch.Tensor]] = []
        self.broken = False
        self.placed = 0
        # with `edges` (a replay's collection): each hooked output's gradient edge, as the
        # layer returned it (before any in-place op on it), for torch.autograd.grad's
        # `inputs`: the backward then runs through every hooked output and no further (no
        # parameter's gradient, so no hook on a parameter runs)
        self.edges: list[Any] | None = [] if edges else None


class OutputSums:
    """The layers' output sums of one collecting thread (see the module's docstring)."""

    def __init__(self, table: LayerTable, root: nn.Module, faults: Faults):
        self._table = table
        self._root = root  # (its own output is the caller's to sum: it is the forward's)
        self._faults = faults
        self._installs = HandleGroup()
        # (layer, output sum) of each summed output, in call order; None: not collecting
        self._sink: list[tuple[int, torch.Tensor]] | None = None
        self._thread = 0
        self._into: list[tuple[int, torch.Tensor]] | None = None  # the collection begun
        self._broken = False  # ... stopped short (a fault, too many calls)
        # ... and its outputs' gradients (None: not collected), held weakly here and by the
        # gradient hooks (the caller owns it: a loop that keeps its outputs keeps no
        # collection alive); one reference a collection, not one a call
        self._grads: weakref.ref[GradientSums] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The wrappers in place for the block (attach to detach): on the layers and on the
        containers (rows past the layers) but the root, whose own code between its children
        (a residual add, a functional attention) can make a wrong value no layer returns."""
        for row, _, module in self._table.named_rows():
            if module is None or module is self._root:
                continue
            handle: Removable | None = None
            if not module._forward_hooks:
                handle = wrap_attribute(module, "forward", row, self._enter, self._end)
            if handle is None:  # (or a module type that refuses the attribute)
                handle = module.register_forward_hook(partial(self._post, row))
            self._installs.add(handle)
        try:
            yield
        finally:
            self._sink = None
            self._installs.remove()

    def collect(
        self, into: list[tuple[int, torch.Tensor]], grads: GradientSums | None = None
    ) -> None:
        """From now on, this thread's layer outputs are summed into `into`, and with `grads`
        their gradients into it as the backward computes them."""
        self._thread = threading.get_ident()
        self._sink = self._into = into
        self._grads = weakref.ref(grads) if grads is not None else None
        self._broken = False

    def stop(self) -> bool:
        """No more is collected (the gradient hooks already placed still fire); True when the
        collection begun last stopped short (its sums are not whole). A second stop says
        False: the flag is the collection's own."""
        broken = self._into is not None and self._broken
        self._sink = self._into = self._grads = None
        self._broken = False
        return broken

    def _enter(self, layer: int, args: Any, kwargs: Any) -> bool:
        # (inside a compiled region: not summed, and no graph break; a step with compiled
        # regions is not replayed: integrity/spike_replay.py)
        return (
            self._sink is not None  # (first: nothing else is asked while not collecting)
            and not is_compiling()
            and threading.get_ident() == self._thread
        )

    def _post(self, layer: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._enter(layer, args, None):
            self._end(layer, output)

    def _end(self, layer: int, output: Any) -> None:
        sink = self._sink
        if sink is None or output is None:
            return
        ref = self._grads
        grads = ref() if ref is not None else None
        try:
            for t in (output,) if isinstance(output, _Tensor) else iter_tensors(output):
                if summable(t):
                    if len(sink) >= MAX_CALLS:
                        self._sink, self._broken = None, True
                        return
                    sink.append((layer, output_checksum(t)))
                    if grads is not None and t.grad_fn is not None:  # (never on a leaf)
                        t.register_hook(partial(self._gradient, ref, layer))
                        grads.placed += 1
                        if grads.edges is not None:
                            grads.edges.append(get_gradient_edge(t))
        except Exception as exc:  # the forward goes on; this collection is not complete
            self._sink, self._broken = None, True
            self._faults.report("spike replay", exc, disable=False)

    def _gradient(self, ref: weakref.ref[GradientSums] | None, layer: int, grad: Any) -> None:
        """A summed output's gradient, as the backward computes it (a tensor hook: it must
        never raise into the backward, and returns nothing, so the gradient is unchanged)."""
        grads = ref() if ref is not None else None
        if grads is None:  # (the collection is over: its step was judged)
            return
        try:
            if grads.broken:
                return
            if len(grads.items) >= MAX_CALLS or not isinstance(grad, _Tensor):
                grads.broken = True
                return
            grads.items.append((layer, output_checksum(grad.detach())))
        except Exception as exc:  # the backward goes on; this collection is not whole
            grads.broken = True
            self._faults.report("spike replay", exc, disable=False)
