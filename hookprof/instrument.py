"""Per-layer hooks, installed only for sampled steps.

Forward: a pre/post hook pair on every layer times each call and (optionally) takes two
device-side reductions of the output. Backward, without `register_full_backward_hook`
(DESIGN.md invariant 1): a tensor hook on each output marks when the gradient reaches the
layer, a tensor hook on each input marks when the layer has produced its input gradient.
Layers whose inputs need no gradient (the first layer) end at their parameters' gradient
accumulation instead. Nothing here reads a device value; everything is appended to the
step's StepRecord and resolved later by the publisher thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from .health import Health
from .layers import LayerTable

_MAX_TENSORS_PER_CALL = 8  # outputs/inputs looked at per call; a tuple of 1,000 is not a layer


class StepRecord:
    """What the hooks of one sampled step wrote. Appends only: list.append is atomic, and
    backward hooks may run on autograd worker threads."""

    __slots__ = (
        "ref",
        "fwd_layer",
        "fwd_parent",
        "fwd_start",
        "fwd_end",
        "fwd_outer",
        "bwd_out",
        "bwd_in",
        "param_done",
        "act",
        "param_hooked",
        "param_handles",
    )

    def __init__(self, ref: Any):
        self.ref = ref  # timer token taken when the step's hooks went in
        self.fwd_layer: list[int] = []  # per forward call (call id = position)
        self.fwd_parent: list[int] = []  # enclosing instrumented call, -1 for none
        self.fwd_start: list[Any] = []
        self.fwd_end: list[Any] = []
        # (first token of the pre-hook, last token of the post-hook) per call: the call's time
        # including our hook work, which is what a parent call must not count as its own
        self.fwd_outer: list[list[Any]] = []
        self.bwd_out: list[tuple[int, Any]] = []  # (call id, token): gradient reached the output
        self.bwd_in: list[tuple[int, Any]] = []  # (call id, token): input gradient produced
        self.param_done: list[tuple[int, Any]] = []  # (layer, token): a parameter's grad accumulated
        self.act: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []  # (call, absmax, nonzero, numel)
        self.param_hooked: set[int] = set()
        self.param_handles: list[Any] = []

    def tokens(self) -> Iterator[Any]:
        """Every timer token in the record, so the timer can take pooled events back."""
        yield self.ref
        yield from self.fwd_start
        yield from (t for t in self.fwd_end if t is not None)
        yield from (t for pair in self.fwd_outer for t in pair)
        yield from (t for _, t in self.bwd_out)
        yield from (t for _, t in self.bwd_in)
        yield from (t for _, t in self.param_done)


def iter_tensors(value: Any, limit: int = _MAX_TENSORS_PER_CALL) -> Iterator[torch.Tensor]:
    """Tensors in a module's inputs or outputs: tensors, tuples/lists, dict values."""
    stack = [value]
    found = 0
    while stack and found < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found += 1
            yield item
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))


class LayerHooks:
    """Installs and removes the per-layer hooks of one sampled step."""

    def __init__(self, table: LayerTable, timer: Any, health: Health, activation_stats: bool):
        self._table = table
        self._timer = timer
        self._health = health
        self._activation_stats = activation_stats
        self._handles: list[Any] = []
        self._rec: StepRecord | None = None
        self._local = threading.local()  # each thread's stack of open forward calls

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, rec: StepRecord) -> None:
        self._rec = rec
        for layer in self._table.layers:
            module = layer.module
            self._handles.append(module.register_forward_pre_hook(partial(self._pre, layer.index)))
            self._handles.append(
                module.register_forward_hook(partial(self._post, layer.index), always_call=True)
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        rec, self._rec = self._rec, None
        if rec is not None:
            for handle in rec.param_handles:
                handle.remove()
            rec.param_handles.clear()
        self._local = threading.local()

    # --- hook bodies: never raise, never return anything, never read a device value ---

    def _stack(self) -> list[int]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre(self, layer_index: int, module: torch.nn.Module, args: Any) -> None:
        rec = self._rec
        if rec is None or self._health.broken or not torch.is_grad_enabled():
            return
        try:
            outer_start = self._timer.mark()
            stack = self._stack()
            call = len(rec.fwd_layer)
            rec.fwd_outer.append([outer_start])
            rec.fwd_layer.append(layer_index)
            rec.fwd_parent.append(stack[-1] if stack else -1)
            rec.fwd_end.append(None)
            inputs_need_grad = False
            for t in iter_tensors(args):
                # non-leaf only: a hook on a leaf (a parameter passed as an input) would
                # outlive the step and survive detach()
                if t.requires_grad and t.grad_fn is not None:
                    inputs_need_grad = True
                    t.register_hook(partial(self._grad_in, rec, call))
            if not inputs_need_grad and layer_index not in rec.param_hooked:
                self._hook_params(rec, layer_index)
            stack.append(call)
            rec.fwd_start.append(self._timer.mark())  # last: our own work stays outside the span
        except Exception as exc:  # invariant 3: count, log once, switch off
            self._health.report("forward pre-hook", exc)

    def _post(self, layer_index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        end = self._timer.mark()  # first: our own work stays outside the span
        rec = self._rec
        if rec is None or self._health.broken or not torch.is_grad_enabled():
            return
        try:
            stack = self._stack()
            if not stack:
                return
            call = stack.pop()
            rec.fwd_end[call] = end
            for t in iter_tensors(output):
                if not t.is_floating_point():
                    continue
                if self._activation_stats and t.numel():
                    d = t.detach()
                    # two device-side reductions, kept on the device: max |x| (NaN and Inf
                    # propagate, so it doubles as the non-finite detector) and non-zeros
                    absmax = torch.linalg.vector_norm(d, ord=float("inf"))
                    rec.act.append((call, absmax, torch.count_nonzero(d), d.numel()))
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(partial(self._grad_out, rec, call))
            rec.fwd_outer[call].append(self._timer.mark())
        except Exception as exc:
            self._health.report("forward hook", exc)

    def _hook_params(self, rec: StepRecord, layer_index: int) -> None:
        rec.param_hooked.add(layer_index)
        for i in self._table.layers[layer_index].param_indices:
            p = self._table.params[i]
            if p.requires_grad:
                rec.param_handles.append(
                    p.register_post_accumulate_grad_hook(partial(self._param_done, rec, layer_index))
                )

    def _grad_out(self, rec: StepRecord, call: int, grad: torch.Tensor) -> None:
        try:
            rec.bwd_out.append((call, self._timer.mark()))
        except Exception as exc:
            self._health.report("backward hook", exc)

    def _grad_in(self, rec: StepRecord, call: int, grad: torch.Tensor) -> None:
        try:
            rec.bwd_in.append((call, self._timer.mark()))
        except Exception as exc:
            self._health.report("backward hook", exc)

    def _param_done(self, rec: StepRecord, layer_index: int, param: torch.Tensor) -> None:
        try:
            rec.param_done.append((layer_index, self._timer.mark()))
        except Exception as exc:
            self._health.report("gradient hook", exc)
