"""Copies of an attached model carry nothing of hookprof.

Owns: the `__reduce_ex__` instance attribute each module of an attached model holds while
hookprof is attached, and the rule for what a copy of a module leaves out.

A model is copied while hookprof is attached more often than not: an EMA model
(`copy.deepcopy`, timm's ModelEmaV3), SWA's `AveragedModel`, `torch.save(model)` of the whole
module, `pickle`, a shallow `copy.copy`. All of them reduce each module through
`__reduce_ex__`, looked up on the instance, so an instance attribute takes the module's place
there: it reduces the module as its class would, then drops from the state what hookprof put
into it (its forward hooks and their bookkeeping entries, a sampled step's forward wrapper,
the attribute itself). The copy is the module as it was before attach: no hookprof hooks, no
hookprof attributes; `torch.jit.script` takes it; a pickle of it names nothing of hookprof and
loads where hookprof is not installed. The original is untouched and stays profiled.

A class with a `__deepcopy__` of its own (torch's parametrized modules: weight_norm,
spectral_norm, orthogonal; torch.fx's GraphModule) copies its `__dict__` wholesale instead:
such a module gets an instance `__deepcopy__` too (CleanDeepcopy), which runs the class's
own and then takes hookprof's part out of the copy's `__dict__`. A pickle of such a class's
module (its own `__reduce__`) keeps hookprof's hooks, which do nothing in the copy.

Called by: StepBoundary.install (attach), which removes it again with the hooks (detach).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import partial
from typing import Any

from torch import nn

from hookprof.step.hooks import ForwardWrapper

ATTRIBUTE = "__reduce_ex__"
DEEPCOPY = "__deepcopy__"

# a module's hook dicts that may hold hookprof's hooks, and the dicts keyed by those hooks'
# ids that say how to call them (handle ids are unique across all dicts)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_KEYED_BY_HOOK = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def is_hookprof_hook(hook: Any) -> bool:
    """Is `hook` hookprof's own (a function or bound method defined in the package, possibly
    under functools.partial)?"""
    while isinstance(hook, partial):
        hook = hook.func
    module = getattr(hook, "__module__", None) or ""
    return module == "hookprof" or module.startswith("hookprof.")


def own_forward(wrapper: ForwardWrapper) -> Any:
    """The module's own instance attribute `forward` under hookprof's wrappers (a sampled
    step's over the spike replay's: step/output_sums.py); None: the class's forward."""
    prior = wrapper.prior
    while isinstance(prior, ForwardWrapper):
        prior = prior.prior
    return prior


def without_hookprof(state: dict[str, Any]) -> dict[str, Any]:
    """A module's reduced state minus what hookprof added (a new dict; `state` is the
    module's own or a copy of it and is not changed)."""
    clean = dict(state)
    if isinstance(clean.get(ATTRIBUTE), CleanReduce):
        del clean[ATTRIBUTE]
    if isinstance(clean.get(DEEPCOPY), CleanDeepcopy):
        del clean[DEEPCOPY]
    forward = clean.get("forward")
    if isinstance(forward, ForwardWrapper):
        prior = own_forward(forward)
        if prior is None:  # the class's forward: no instance attribute to restore
            del clean["forward"]
        else:
            clean["forward"] = prior
    removed: set[int] = set()
    for name in _HOOK_DICTS:
        hooks = clean.get(name)
        if hooks and any(is_hookprof_hook(h) for h in hooks.values()):
            removed.update(k for k, h in hooks.items() if is_hookprof_hook(h))
            clean[name] = OrderedDict((k, h) for k, h in hooks.items() if k not in removed)
    if removed:
        for name in _KEYED_BY_HOOK:
            flags = clean.get(name)
            if flags and not removed.isdisjoint(flags):
                clean[name] = OrderedDict((k, v) for k, v in flags.items() if k not in removed)
    return clean


class CleanReduce:
    """One module's `__reduce_ex__` while attached: its class's reduction, minus hookprof."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module | None):
        self._module = weakref.ref(module) if module is not None else _nothing

    def __call__(self, protocol: int) -> Any:
        module = self._module()
        if module is None:  # a copy made by a class's own __deepcopy__/__reduce__ (see above)
            raise TypeError(
                "this module was copied while hookprof was attached by a class that "
                "copies its __dict__ itself; copy it after prof.detach()"
            )
        reduced = type(module).__reduce_ex__(module, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3:
            return reduced
        state = reduced[2]
        if isinstance(state, dict):
            state = without_hookprof(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            state = (without_hookprof(state[0]), state[1])  # (__dict__, __slots__ values)
        else:
            return reduced  # a state of the class's own making: nothing of ours to find
        return (*reduced[:2], state, *reduced[3:])

    def __deepcopy__(self, memo: dict) -> Any:
        # only a class that deep-copies its __dict__ itself gets here; rebind to its copy
        module = self._module()
        copied = memo.get(id(module)) if module is not None else None
        return CleanReduce(copied if isinstance(copied, nn.Module) else None)

    def __reduce__(self) -> Any:
        return (CleanReduce, (None,))


def _nothing() -> None:
    return None


class CleanDeepcopy:
    """The `__deepcopy__` of a module whose class has one of its own, while attached: the
    class's copy, minus hookprof."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    def __call__(self, memo: dict) -> Any:
        module = self._module()
        assert module is not None  # (called as the module's own __deepcopy__: it is alive)
        copied = type(module).__deepcopy__(module, memo)  # type: ignore[attr-defined]  # ours
        state = getattr(copied, "__dict__", None)
        if isinstance(state, dict):
            clean = without_hookprof(state)
            wrapper = module.__dict__.get("forward")
            if isinstance(wrapper, ForwardWrapper) and own_forward(wrapper) is None:
                # the class's copy took the wrapper's own copy: the copy's bound forward
                clean.pop("forward", None)
            state.clear()
            state.update(clean)
        return copied

    def __deepcopy__(self, memo: dict) -> Any:
        return self  # inside the class's copy of the __dict__: taken out right after


class Placed:
    """The CleanReduce (and CleanDeepcopy) attributes placed on a model's modules; `remove()`
    takes each away where it is still ours (a handle, like torch's RemovableHandle)."""

    def __init__(self, model: nn.Module):
        self._placed: list[tuple[weakref.ref, str, Any]] = []  # (module, attribute, ours)
        for module in model.modules():
            if ATTRIBUTE in module.__dict__ or _is_script(module):
                continue  # a reduction of the module's own (or a ScriptModule's C++ state): left alone
            reducer = CleanReduce(module)
            module.__dict__[ATTRIBUTE] = reducer
            self._placed.append((weakref.ref(module), ATTRIBUTE, reducer))
            if (
                getattr(type(module), DEEPCOPY, None) is not None
                and DEEPCOPY not in module.__dict__
            ):
                copier = CleanDeepcopy(module)
                module.__dict__[DEEPCOPY] = copier
                self._placed.append((weakref.ref(module), DEEPCOPY, copier))

    def remove(self) -> None:
        for ref, attribute, ours in self._placed:
            module = ref()
            if module is not None and module.__dict__.get(attribute) is ours:
                del module.__dict__[attribute]
        self._placed.clear()


def _is_script(module: nn.Module) -> bool:
    import torch.jit

    return isinstance(module, torch.jit.ScriptModule)
