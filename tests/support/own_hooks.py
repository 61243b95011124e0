"""Where a run first went non-finite, told by hooks of the test's own, apart from hookprof:
the answer hookprof's first NaN/Inf event is checked against on divergences nobody injected.

- forward: a forward hook on every leaf module with parameters (hookprof's layers) notes the
  modules whose output holds a NaN or Inf, in the order they returned;
- loss: the loop hands its loss in (`loss`);
- backward: a hook on every parameter (`Tensor.register_hook`, which sees each gradient as
  backward computes it, before it is accumulated into `.grad` and before anything after
  backward() changes it) notes the parameters whose gradient holds a NaN or Inf, in the
  order backward computed them.

The first step with any finding is the first non-finite step; its phase is the first of
forward, loss, backward that saw one, and its layer the first module (forward) or the
module of the first parameter (backward) noted. hookprof's own replay runs forwards again:
those calls are not the training's and are not noted (`replaying`, set by the test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


def _bad(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value.detach()).all())
    if isinstance(value, (tuple, list)):
        return any(_bad(v) for v in value)
    if isinstance(value, dict):
        return any(_bad(v) for v in value.values())
    return False


@dataclass
class OwnHooks:
    """Attach with `watch(model)`; call `stepped()` after each optimizer step and `loss(l)`
    with each loss; `first()` gives (phase, layer, step) or None."""

    step: int = 1
    forward: dict[int, list[str]] = field(default_factory=dict)
    losses: set[int] = field(default_factory=set)
    grads: dict[int, list[str]] = field(default_factory=dict)
    replaying: Callable[[], bool] = lambda: False
    handles: list = field(default_factory=list)

    def watch(self, model: nn.Module) -> OwnHooks:
        for name, module in model.named_modules():
            if (
                next(module.children(), None) is None
                and next(module.parameters(recurse=False), None) is not None
            ):
                self.handles.append(module.register_forward_hook(self._forward_hook(name)))
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._grad_hook(name.rpartition(".")[0])))
        return self

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            if torch.is_grad_enabled() and not self.replaying() and _bad(output):
                self.forward.setdefault(self.step, []).append(name)

        return hook

    def _grad_hook(self, layer: str):
        def hook(grad):
            if _bad(grad):
                self.grads.setdefault(self.step, []).append(layer)

        return hook

    def loss(self, value: torch.Tensor) -> None:
        if _bad(value):
            self.losses.add(self.step)

    def stepped(self) -> None:
        self.step += 1

    def first(self) -> tuple[str, str | None, int] | None:
        steps = set(self.forward) | self.losses | set(self.grads)
        if not steps:
            return None
        step = min(steps)
        if step in self.forward:
            return ("forward", self.forward[step][0], step)
        if step in self.losses:
            return ("loss", None, step)
        return ("backward", self.grads[step][0], step)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
