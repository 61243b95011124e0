"""The process's one pair of torch optimizer step hooks, dispatching to the live listeners.

Owns: the single registration of `register_optimizer_step_pre_hook` and
`register_optimizer_step_post_hook` in this process, the tuples of listeners (each
profiler's `StepBoundary`) they call, and which optimizers a GradScaler is deciding stepped
(`deciding`, for step/gradscaler.py).

Why once: `torch.optim.Optimizer.step` iterates torch's global hook OrderedDicts without a
lock. A profiler that added or removed its own global hook while another thread's optimizer
stepped made that step raise `RuntimeError: OrderedDict mutated during iteration` in the
user's loop (two models trained on two threads, or detach() from another thread). So the
hooks are registered on the first `listen` and never removed (DESIGN.md invariant 10);
`listen` and `Listening.remove` only swap an immutable tuple under a lock, never mutating
what a running step iterates. With no listener the two hooks return at once: an inert pair of
entries in torch's dicts is all hookprof leaves in a process after its last detach. Removing
them then would be safe only if no optimizer step could be running in any thread, which
hookprof cannot know (a step of an unprofiled model iterates the same dicts).

A listener removed while a step runs may still be called once by that step (it iterates the
tuple it read): listeners check their own detached flag.

Called by: `StepBoundary.install` (step/boundary.py), `gradscaler.watch`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# (optimizer, args, kwargs) -> None or (args, kwargs), as torch's own hooks
Hook = Callable[[Any, Any, Any], Any]

_lock = threading.Lock()
_pre: tuple[Hook, ...] = ()
_post: tuple[Hook, ...] = ()
_registered = False  # torch's hooks are in (once per process, never removed)
# optimizers (by id) a GradScaler is deciding (step/gradscaler.py) -> whether their step ran:
# set here, by the pre-hook, so that telling it takes no listener (a Python call per step)
deciding: dict[int, bool] = {}


class Listening:
    """What `listen()` returns: `remove()` ends it (idempotent; safe from any thread)."""

    def __init__(self, pre: Hook | None, post: Hook | None):
        self._pre, self._post = pre, post
        self._removed = False

    def remove(self) -> None:
        global _pre, _post
        with _lock:
            if self._removed:
                return
            self._removed = True
            # new tuples: a step iterating the old ones goes on undisturbed
            if self._pre is not None:
                _pre = tuple(h for h in _pre if h is not self._pre)
            if self._post is not None:
                _post = tuple(h for h in _post if h is not self._post)


def listen(pre: Hook | None = None, post: Hook | None = None) -> Listening:
    """Call `pre` before and `post` after every optimizer step of this process (neither:
    only torch's hooks put in, for `deciding`)."""
    global _pre, _post, _registered
    with _lock:
        if not _registered:
            register_optimizer_step_pre_hook(_dispatch_pre)
            register_optimizer_step_post_hook(_dispatch_post)
            _registered = True
        if pre is not None:
            _pre = (*_pre, pre)
        if post is not None:
            _post = (*_post, post)
    return Listening(pre, post)


def listeners() -> tuple[int, int]:
    """How many pre and post listeners are live (tests look at this)."""
    return len(_pre), len(_post)


def _dispatch_pre(optimizer: Any, args: Any, kwargs: Any) -> Any:
    if deciding and id(optimizer) in deciding:
        deciding[id(optimizer)] = True
    hooks = _pre  # one read: the tuple is never changed in place
    if not hooks:
        return None
    changed = False
    for hook in hooks:
        result = hook(optimizer, args, kwargs)
        if result is not None:  # a wrapped closure: the next listener sees the new arguments
            args, kwargs = result
            changed = True
    return (args, kwargs) if changed else None


def _dispatch_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    for hook in _post:
        hook(optimizer, args, kwargs)


def others_around_update() -> bool:
    """Does another global optimizer step hook run between hookprof's pre-hook and the
    update (a pre-hook registered after hookprof's), or between the update and hookprof's
    post-hook (a post-hook registered before hookprof's first `listen`)? Such a hook may
    write the gradients or the parameters where hookprof cannot see it (torch runs the
    global pre-hooks in the order they were registered, then the optimizer's own; its own
    post-hooks, then the global ones)."""
    from torch.optim import optimizer as torch_optimizer

    pre = tuple(getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values())
    post = tuple(getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values())
    return not (pre and pre[-1] is _dispatch_pre and post and post[0] is _dispatch_post)
