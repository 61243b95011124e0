"""FLOPs per layer call, counted once per input signature on meta tensors.

On a sampled step each layer call notes its input signature (shapes, dtypes, which inputs
need a gradient, the plain values among the arguments): a few tuple builds, nothing read
from the device. At the step's end (training thread) every signature not seen before is
counted: a copy of the layer whose parameters and buffers are meta tensors runs forward and
backward on meta inputs of the same shapes under `torch.utils.flop_counter.FlopCounterMode`.
Meta tensors have shapes and no data, so this never touches the device, never syncs,
never consumes the random generator and cannot change the real layer (its copy has its own
parameter, buffer and module dicts and none of the hooks). The result is cached by (layer,
signature) and shared by layers of one kind (same class, configuration and parameter
shapes: the 24 blocks of a transformer are counted once); a layer whose forward cannot run on meta
tensors (it reads a value, builds a
tensor on a fixed device) has no FLOPs, said once in the notices.

Counting runs on the training thread at the step boundary because FlopCounterMode's module
tracker registers process-wide module hooks while it is active: no other module call of the
process may run meanwhile.

A layer's FLOPs include whatever it calls (a layer with children counts theirs too: its
time excludes instrumented children, its FLOPs do not); the model's FLOPs per step add up
the calls with no instrumented caller, so nothing is counted twice.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hookprof.compiled import unwrap_compiled
from hookprof.layers import LayerTable
from hookprof.step.hooks import ForwardWrapper

MAX_COUNTS_PER_STEP = (
    32  # new signatures counted at one step boundary; the rest on later sampled steps
)
MAX_SIGNATURES_PER_LAYER = 8  # kept per layer (variable sequence lengths): oldest dropped first
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _Meta:
    """A tensor argument, by description: what a meta tensor is built from."""

    __slots__ = ("shape", "dtype", "requires_grad")

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.requires_grad = t.requires_grad

    def build(self) -> torch.Tensor:
        """Under grad mode. A tensor that required a gradient was an activation in the real
        call, not a leaf: built as one (a clone), so that an in-place layer (ReLU(inplace=True),
        in every torchvision ResNet) runs on it instead of raising on a leaf."""
        t = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return t.requires_grad_().clone() if self.requires_grad else t


def _key(value: Any) -> Any:
    """A hashable signature of one argument: tensors by shape, dtype and requires_grad;
    containers one level down; plain values by value; anything else by type."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.requires_grad)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)):
        return (
            type(value),
            tuple(
                _key(v) if isinstance(v, torch.Tensor) or isinstance(v, _SCALARS) else type(v)
                for v in value
            ),
        )
    return type(value)


def _kind(module: torch.nn.Module) -> Any:
    """What makes two layers compute alike: class, configuration, parameter and buffer shapes."""
    try:
        config = module.extra_repr()
    except Exception:
        return id(module)  # a layer of its own kind
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in (*module.named_parameters(), *module.named_buffers())
    )
    return (type(module), config, tensors)


def _meta_clone(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` with meta parameters and buffers, no hooks and its class's own
    forward, sharing nothing mutable with the original. A DTensor parameter (FSDP2) gets
    its full shape: FSDP computes with the gathered parameter."""
    clone = copy.copy(module)
    clone.__dict__ = dict(module.__dict__)
    # a module compiled on its own (module.compile()) runs its class's code here: its
    # compiled call belongs to the original module (and would compile again for meta inputs)
    clone.__dict__.pop("_compiled_call_impl", None)
    for name, value in module.__dict__.items():
        if isinstance(value, torch.Tensor):  # a plain tensor attribute (a counter, a cache):
            # on meta too, or the copy's forward would write into the real one
            clone.__dict__[name] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    own = clone.__dict__.pop("forward", None)
    if own is not None:
        target = own
        while isinstance(target, ForwardWrapper):  # hookprof's (a sampled step's, a replay's)
            target = target.__wrapped__
        if getattr(target, "__self__", None) is not module:
            raise TypeError("an instance forward not bound to the module")  # someone else's wrapper
        if getattr(target, "__func__", None) is not type(module).forward:
            clone.forward = target.__func__.__get__(clone)
    clone._parameters = {
        name: None
        if p is None
        else torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
        for name, p in module._parameters.items()
    }
    clone._buffers = {
        name: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
        for name, b in module._buffers.items()
    }
    # a child put in torch.compile's wrapper runs its module's code here, eagerly
    clone._modules = {
        name: None if m is None else _meta_clone(unwrap_compiled(m)[0])
        for name, m in module._modules.items()
    }
    for hooks in (
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    ):
        if hooks in clone.__dict__:
            clone.__dict__[hooks] = OrderedDict()
    return clone


def count(module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[int, int]:
    """(forward FLOPs, backward FLOPs) of one call of `module` with arguments described by
    `args`/`kwargs` (tensors replaced by _Meta). Raises when the layer cannot run on meta
    tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    clone = _meta_clone(module)
    clone.train(module.training)
    with torch.enable_grad():  # the meta inputs are built under it too: see _Meta.build
        margs, mkwargs = tree_map(
            lambda v: v.build() if isinstance(v, _Meta) else v,
            (args, kwargs),
            is_leaf=lambda v: isinstance(v, _Meta),
        )
        with FlopCounterMode(display=False) as counter:
            out = clone(*margs, **mkwargs)
            forward = counter.get_total_flops()
            leaves = [
                t
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
            ]
            if leaves:
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
            backward = counter.get_total_flops() - forward
    return forward, backward if leaves else 0


class FlopCounter:
    """Per-layer FLOPs of sampled steps: `note` in each call (training thread), `end_step`
    at the step boundary returns the step's per-layer and per-step totals."""

    def __init__(self, table: LayerTable, notices: Any = None):
        self._table = table
        self._notices = notices
        # per layer kind: signature -> (forward, backward); layers of one kind share one.
        # By row: the layers, then the containers, whose caches are made at their first call
        # (a container compiled on its own is called, and counted, as one unit; most
        # containers are never called through hookprof, and a kind reads every parameter)
        self._layers = len(table.layers)
        self._shared: dict[Any, OrderedDict] = {}
        # per row: its kind's signatures (None: a container, until its first call)
        self._cache: list[Any] = [
            self._shared.setdefault(
                _kind(layer.module) if layer.module is not None else object(), OrderedDict()
            )
            for layer in table.layers
        ] + [None] * (table.rows - len(table.layers))
        self._calls: list[tuple[int, Any, bool]] = []  # (layer, key, nested) of this step
        # (id of a kind's cache, signature) -> (layer, args, kwargs) to count at the step's end
        self._pending: dict[tuple[int, Any], tuple[int, Any, Any]] = {}
        self._failed: set[int] = set()  # layers that cannot run on meta tensors

    def note(self, layer: int, args: tuple, kwargs: dict | None, nested: bool) -> None:
        """A layer call on a sampled step (not a recomputation). Called by LayerHooks for
        each call: never raises (a failure is said once, in the notices)."""
        try:
            if layer >= len(self._cache) or layer in self._failed:
                return
            if layer < self._layers:
                module = self._table.layers[layer].module
            else:  # a compiled region's row (torch.compile's wrapper when compiled before attach)
                row = self._table.row_module(layer)
                module = None if row is None else unwrap_compiled(row)[0]
            if module is None:
                return
            cache = self._cache[layer]
            if cache is None:  # a container's first call
                cache = self._cache[layer] = self._shared.setdefault(_kind(module), OrderedDict())
            key: Any
            if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
                a = args[0]  # forward(x), inline: the same key as below for ~1/3 of its cost
                key = (module.training, ((a.shape, a.dtype, a.requires_grad),))
            else:
                key = (module.training, tuple(_key(a) for a in args))
            if kwargs:
                key = (key, tuple((k, _key(v)) for k, v in kwargs.items()))
            self._calls.append((layer, key, nested))
            if key not in cache and (id(cache), key) not in self._pending:
                describe = lambda v: _Meta(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
                self._pending[(id(cache), key)] = (
                    layer,
                    *tree_map(describe, (tuple(args), dict(kwargs or {}))),
                )
        except Exception as exc:  # never into the training loop, nor switching the hooks off
            if self._notices is not None:
                self._notices.say(
                    "flops note",
                    f"FLOPs of layer calls cannot be noted ({exc!r}): FLOP figures may be missing",
                )

    def drop(self) -> None:
        """The step is not reported (its hooks failed, or it was skipped)."""
        self._calls.clear()
        self._pending.clear()

    def end_step(self) -> tuple[list[int], list[int], list[int], int]:
        """Count what is new, then the step's totals: per layer (forward FLOPs, backward
        FLOPs, calls with a count), and the model's FLOPs (forward and backward) of the
        step."""
        for n, ((_, key), (layer, args, kwargs)) in enumerate(list(self._pending.items())):
            if n >= MAX_COUNTS_PER_STEP:
                break
            module = self._table.row_module(layer)
            if module is None:  # the model is gone
                continue
            try:
                result = count(unwrap_compiled(module)[0], args, kwargs)
            except Exception as exc:
                self._failed.update(
                    i
                    for i, c in enumerate(self._cache)
                    if c is not None and c is self._cache[layer]
                )
                if self._notices is not None:
                    name = self._table.row_name(layer)
                    self._notices.say(
                        f"flops {name}",
                        (
                            f"FLOPs of layer {name} cannot be counted on meta tensors "
                            f"({type(exc).__name__}: {str(exc)[:160]}): it has no FLOP figures"
                        ),
                    )
                continue
            cache = self._cache[layer]
            cache[key] = result
            if len(cache) > MAX_SIGNATURES_PER_LAYER:
                cache.popitem(last=False)
        self._pending.clear()
        n = len(self._cache)
        fwd, bwd, calls = [0] * n, [0] * n, [0] * n
        model = 0
        for layer, key, nested in self._calls:
            counted = self._cache[layer].get(key)  # (noted, so made)
            if counted is None:
                continue  # counted on a later step (or never, for a layer that failed)
            fwd[layer] += counted[0]
            bwd[layer] += counted[1]
            calls[layer] += 1
            if not nested:
                model += counted[0] + counted[1]
        self._calls.clear()
        return fwd, bwd, calls, model
