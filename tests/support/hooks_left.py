"""What hookprof could leave behind on a model or in torch, read from torch's own hook
registries: to prove that detach() (or an attach that failed) left nothing.

These are torch's private dicts (there is no public way to list hooks); every read of them
in the tests is here, so that a torch release that renames one breaks one file."""

from __future__ import annotations

import threading

import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals
from torch.amp.grad_scaler import GradScaler

GLOBAL_HOOK_DICTS = [
    module_globals._global_forward_hooks,
    module_globals._global_forward_pre_hooks,
    module_globals._global_backward_hooks,
    module_globals._global_backward_pre_hooks,
    optimizer_globals._global_optimizer_pre_hooks,
    optimizer_globals._global_optimizer_post_hooks,
]
MODULE_HOOK_DICTS = [
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
]


def global_hook_counts() -> list[int]:
    """How many hooks each of torch's global module and optimizer hook registries holds."""
    return [len(d) for d in GLOBAL_HOOK_DICTS]


def dispatcher_hook_counts() -> list[int]:
    """How many of those hooks are hookprof's process-wide dispatcher (step/dispatch.py): one
    per optimizer registry once anything attached in this process, never removed."""
    from hookprof.step import dispatch

    ours = (dispatch._dispatch_pre, dispatch._dispatch_post)
    return [sum(1 for h in d.values() if h in ours) for d in GLOBAL_HOOK_DICTS]


def foreign_global_hook_counts() -> list[int]:
    """global_hook_counts() without the dispatcher's hooks."""
    return [n - ours for n, ours in zip(global_hook_counts(), dispatcher_hook_counts())]


def model_state(model: torch.nn.Module) -> dict:
    """Everything hookprof could leave behind on a model: attribute names, hook dicts,
    parameter hooks."""
    state = {}
    for name, m in model.named_modules():
        state[name] = {
            "attrs": sorted(vars(m)),
            **{d: len(getattr(m, d)) for d in MODULE_HOOK_DICTS},
        }
    for name, p in model.named_parameters():
        state["param:" + name] = (
            len(p._post_accumulate_grad_hooks or {}),
            len(p._backward_hooks or {}),
            sorted(vars(p)),
        )
    return state


def forward_hooks(module: torch.nn.Module) -> list:
    """The module's own forward hooks and forward pre-hooks (in that order)."""
    return [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]


def forward_pre_hooks(module: torch.nn.Module) -> list:
    """The module's own forward pre-hooks."""
    return list(module._forward_pre_hooks.values())


def post_accumulate_grad_hooks(param: torch.Tensor) -> list:
    """The hooks torch runs once this parameter's gradient is accumulated."""
    return list((param._post_accumulate_grad_hooks or {}).values())


def gradscaler_step_decider():
    """What GradScaler calls to decide whether to step (hookprof wraps it while attached)."""
    return GradScaler._maybe_opt_step


def hookprof_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hookprof")]
