"""The end of a backward pass through the model: the moment its gradients are as backward
left them, before anything between `backward()` and the optimizer changes them.

Why not at the optimizer: code in between rewrites gradients. transformers' Trainer calls
`clip_grad_norm_(params, max_norm)` every step (with `max_norm=inf` only to log the norm);
once one gradient is NaN the total norm is NaN and the clip multiplies *every* gradient by
NaN, so at the optimizer all layers look bad at once and the first of them in backward
order is not the one that went wrong (issue 38). A user's NaN guard that zeroes the
gradients and skips the update hides the step altogether. At the backward's end neither
has happened yet.

How: when the model's training forward returns, a pre-hook goes on the autograd node of
each of its output tensors (one or two per step; the nodes die with the graph, so nothing
is left to remove). The first of them to run in a backward, early in it, queues one
callback with autograd's engine (`queue_callback`, the mechanism DDP's reducer finalises
with); the engine runs it once that backward's graph is done, before `backward()` returns,
with the caller's streams current. On an accelerator it may run on autograd's device
thread while the training thread waits in `backward()`.

A model that runs compiled has its root hooks traced into the graph, where no node hook
can be registered: there the callback is queued from a post-accumulate-grad hook on two of
its parameters (`watch_params`: the first and the last that train; AccumulateGrad runs
outside the compiled graph), one Python call each per backward, on compiled models only.

A backward that reaches neither (a compiled model whose two watched parameters are frozen),
or runs under `torch.autograd.grad` (which writes no .grad: training that puts its
gradients into .grad by hand), queues nothing: the gradients are then read at the
optimizer, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookprof.tensors import iter_tensors

_MAX_NODES = 8  # output tensors watched per forward: one reaching the backward is enough


_ENGINE = torch.autograd.Variable._execution_engine
# asked of a parameter's AccumulateGrad node inside a graph task, this raises under
# torch.autograd.grad (which writes no .grad: a check of .grad at its end would read the
# last step's gradients) and answers under backward(); the same query torch's own
# multi-gradient hooks make
_WILL_EXECUTE: Any = getattr(torch._C, "_will_engine_execute_node", None)


def accumulator_of(param: torch.Tensor) -> Any:
    """The AccumulateGrad node of a parameter (the node autograd writes its .grad with)."""
    with torch.enable_grad():
        node: Any = param.view_as(param).grad_fn  # (a view of a leaf: never None)
        return node.next_functions[0][0]


class BackwardEnd:
    """Calls `on_end()` once at the end of each backward pass that reaches a watched output,
    never once `closed` is set (detach). What it raises is a fault of "backward end" in
    `faults` (training goes on; the step's gradients are then read at the optimizer)."""

    __slots__ = (
        "on_end",
        "_faults",
        "_queued",
        "closed",
        "keep_output_grads",
        "output_grads",
        "_param_handles",
        "_accumulator",
    )

    def __init__(
        self,
        on_end: Callable[[], None],
        faults: Any,
        *,
        keep_output_grads: bool = False,
        params: Sequence[torch.Tensor] = (),
    ):
        self.on_end = on_end  # what a backward's end calls (the profiler may set it later)
        self._faults = faults
        # one trainable parameter's AccumulateGrad node: tells backward() from autograd.grad
        trained = [p for p in params if p.requires_grad and p.is_leaf]
        self._accumulator = (
            accumulator_of(trained[0]) if trained and _WILL_EXECUTE is not None else None
        )
        self._queued = False  # a callback is queued for the backward in progress
        self.closed = False
        # the gradient each output tensor of the last forward received (the incident capsule
        # of a backward NaN re-runs the backward from them: no loss function needed), in
        # iter_tensors order, None where none came; references, until the next forward
        self.keep_output_grads = keep_output_grads
        self.output_grads: list[torch.Tensor | None] = []
        self._param_handles: list[Any] = []  # watch_params' hooks (removed by `remove`)

    def watch_params(self, params: Sequence[torch.Tensor]) -> None:
        """The model runs compiled: queue the end from the first and the last trainable
        parameter's accumulation (once; `remove` takes them out)."""
        if self._param_handles:
            return
        trained = [p for p in params if p.requires_grad]
        for p in dict.fromkeys(id(p) for p in trained[:1] + trained[-1:]):
            param = next(q for q in trained if id(q) == p)
            self._param_handles.append(param.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, param: torch.Tensor) -> None:
        self._began(None)

    def remove(self) -> None:
        self.closed = True
        self.output_grads = []  # (references to the last backward's output gradients)
        for handle in self._param_handles:
            handle.remove()
        self._param_handles.clear()

    def watch(self, output: Any) -> None:
        """The model's training forward returned `output`: hook the nodes that make it."""
        # a backward that raised never ran its callback: whatever ran before this forward is over
        self._queued = False
        if self.keep_output_grads:
            self._watch_keeping(output)
            return
        if type(output) is torch.Tensor:  # the usual output: no walk
            node = output.grad_fn
            if node is not None:
                node.register_prehook(self._began)
            return
        seen: set[int] = set()
        for t in iter_tensors(output):
            node = t.grad_fn
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            node.register_prehook(self._began)
            if len(seen) == _MAX_NODES:
                break

    def _watch_keeping(self, output: Any) -> None:
        """watch(), keeping each output tensor's gradient as its node receives it, into a
        list of this forward's own (a graph of an earlier forward, still alive, writes into
        its own list, never into this one's)."""
        tensors = list(iter_tensors(output))
        kept: list[torch.Tensor | None] = [None] * len(tensors)
        self.output_grads = kept
        by_node: dict[Any, list[tuple[int, int]]] = {}
        for k, t in enumerate(tensors):
            if t.grad_fn is not None:
                by_node.setdefault(t.grad_fn, []).append((k, t.output_nr))
        for node, places in list(by_node.items())[:_MAX_NODES]:
            node.register_prehook(functools.partial(self._began_keeping, kept, places))

    def _began_keeping(
        self, kept: list[torch.Tensor | None], places: list[tuple[int, int]], grad_outputs: Any
    ) -> None:
        try:
            for k, nr in places:
                g = grad_outputs[nr] if nr < len(grad_outputs) else None
                kept[k] = None if g is None else g.detach()
        except Exception as exc:  # never into the user's backward()
            self._faults.report("backward end", exc, disable=False)
        return self._began(grad_outputs)

    def _began(self, grad_outputs: Any) -> None:
        """A backward reached the model's output (its gradient is ready): queue the end once."""
        if not self._queued and not self.closed:
            if self._accumulator is not None:
                try:
                    _WILL_EXECUTE(self._accumulator)
                except RuntimeError:  # torch.autograd.grad: no .grad written, read at the update
                    return None
            self._queued = True
            try:
                _ENGINE.queue_callback(self._ended)
            except Exception as exc:  # (outside an engine's graph task: not from a node hook)
                self._queued = False
                self._faults.report("backward end", exc, disable=False)
        return None

    def _ended(self) -> None:
        self._queued = False
        if not self.closed:
            try:
                self.on_end()
            except Exception as exc:  # never into the user's backward()
                self._faults.report("backward end", exc, disable=False)
