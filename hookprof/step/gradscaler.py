"""GradScaler's skip decisions, seen where the scaler makes them instead of guessed.

A GradScaler skips the update of a step whose gradients overflowed. With a plain optimizer
it skips by not calling `optimizer.step()`: no optimizer hook runs, and nothing in the shape
of the loop tells a skipped step from a model called several times per step (siamese nets,
GAN discriminators) or a hand-written update. So hookprof watches the one method where the
scaler decides, `GradScaler._maybe_opt_step`, and the process's optimizer pre-hook
(step/dispatch.py: registered once, never removed, so that no watch changes what a running
optimizer step iterates) tells whether the optimizer then stepped (`dispatch.deciding`: no
listener of its own, so an ordinary step makes no Python call for it). The wrapper sits on the
class while at least one profiler watches and is removed with the last (swapping a class
attribute disturbs no call in progress: a decision already inside the wrapper finishes
there); it adds no device work (the scaler has already read its flag when it decides). The
watchers are a tuple replaced under the lock, never changed while a decision reads it.

Fused optimizers (`_step_supports_amp_scaling`) are always stepped and skip on the device
through `optimizer.found_inf`: not a host decision, so not seen here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hookprof.step import dispatch

try:
    from torch.amp.grad_scaler import GradScaler
except ImportError:  # torch < 2.3 keeps it under torch.cuda.amp only
    GradScaler = None  # type: ignore[assignment,misc]

Watcher = Callable[[Any, bool], None]  # (optimizer, skipped)

_lock = threading.Lock()
_watchers: tuple[Watcher, ...] = ()  # replaced, never changed in place
_installed: Any = None  # the original method, while the wrapper is in


class Watch:
    """What `watch()` returns: `remove()` ends it (idempotent)."""

    def __init__(self, watcher: Watcher):
        self._watcher: Watcher | None = watcher

    def remove(self) -> None:
        global _installed, _watchers
        with _lock:
            if self._watcher is None:
                return
            watcher, self._watcher = self._watcher, None
            _watchers = tuple(w for w in _watchers if w is not watcher)
            if not _watchers and _installed is not None:
                GradScaler._maybe_opt_step = _installed  # type: ignore[method-assign]
                _installed = None


def watch(watcher: Watcher) -> Watch:
    """Call `watcher(optimizer, skipped)` after each GradScaler decision of this process."""
    global _installed, _watchers
    with _lock:
        if GradScaler is not None and _installed is None:
            original = GradScaler.__dict__["_maybe_opt_step"]
            dispatch.listen()  # (torch's hooks in: they say whether the optimizer stepped)
            GradScaler._maybe_opt_step = _deciding(original)  # type: ignore[method-assign]
            _installed = original
        _watchers = (*_watchers, watcher)
    return Watch(watcher)


def _deciding(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_opt_step(
        self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any
    ) -> Any:
        key = id(optimizer)
        dispatch.deciding[key] = False  # (True once its step's pre-hooks ran)
        try:
            result = original(self, optimizer, optimizer_state, *args, **kwargs)
        finally:
            skipped = not dispatch.deciding.pop(key, False)
        for watcher in _watchers:  # the tuple read now: a watch ending meanwhile is not disturbed
            watcher(optimizer, skipped)
        return result

    _maybe_opt_step.__wrapped__ = original  # type: ignore[attr-defined]
    return _maybe_opt_step
