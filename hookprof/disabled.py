"""What `attach()` returns under HOOKPROF_DISABLE=1 (or Config.disable): a profiler with
the same public surface that does nothing, so a training script needs no `if` around hookprof.

Owns nothing but its model reference and its detached flag. Built by `hookprof.attach`."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from hookprof.config import Config
from hookprof.errors import DetachedError
from hookprof.publish.document import document
from hookprof.publish.history import History
from hookprof.snapshot import Snapshot
from hookprof.step.record import checked_sample_losses


class DisabledProfiler:
    """What attach() returns under HOOKPROF_DISABLE=1: the same surface, doing nothing."""

    enabled = False
    url = None
    port = None
    collector = None
    registry = None

    def __init__(self, model: nn.Module, config: Config):
        self.model = model
        self.config = config
        self.name = config.name or type(model).__qualname__
        self.rank = 0
        self._detached = False

    @property
    def detached(self) -> bool:
        return self._detached

    steps = 0

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def flush(self, timeout: float | None = 10.0) -> bool:
        return True

    def step(self, loss: Any = None, *, sample_losses: Any = None) -> None:
        if sample_losses is not None:  # (the same clear error as when enabled)
            checked_sample_losses(sample_losses)
        if self._detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")

    def report_document(self, recent: int | None = None) -> dict[str, Any]:
        return document(self.name, Snapshot(), History([]), recent)

    def expect_slow(self, what: str = "slow section") -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def detach(self) -> None:
        self._detached = True

    def report(self, path: str | None = None) -> str:
        said = "hookprof is disabled (HOOKPROF_DISABLE or Config.disable): nothing was recorded"
        if path is None:
            return said
        from hookprof.view.report_html import write  # the page's code loads when first drawn

        return write(path, [], source=said)

    def __enter__(self) -> DisabledProfiler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return "<hookprof.Profiler disabled (HOOKPROF_DISABLE)>"


class InertProfiler:
    """What a copy of an attached profiler holds in its place (copy.deepcopy of an object
    holding one; unpickling a whole-model checkpoint saved while attached, including by
    hookprof versions whose model hooks were the Profiler's own methods): detached, and
    every hook those versions put on a model does nothing, so such a checkpoint loads and
    trains unprofiled. Only the original is profiled."""

    enabled = False
    detached = True

    def detach(self) -> None:
        pass

    def _ignore(self, *args: Any, **kwargs: Any) -> None:
        return None

    # the hooks checkpoints saved under earlier hookprof versions refer to by name
    _on_root_forward = _on_root_output = _on_entry_forward = _on_entry_output = _ignore
    _on_optimizer_pre = _on_optimizer_post = _on_scaler_decision = _ignore

    def __repr__(self) -> str:
        return "<hookprof.Profiler copy (inert)>"
