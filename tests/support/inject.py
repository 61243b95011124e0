"""Every way the tests put a NaN (or an Inf) into training, written once.

- StepInjector: a layer's output goes non-finite on given training steps. Keyed by the step
  the loop sets (`.step`), not by a call count, so hookprof's replay of that step reproduces
  it, as it reproduces a NaN that comes from the data or the parameters.
- BadBatch: a layer's output (or its gradient) goes NaN whenever one particular batch runs
  through the model (a data-dependent overflow), so it recurs when that batch's forward is
  replayed later (the batch is recognised by its values: the replay runs on a copy).
- NanAt: a layer of its own that makes its input NaN on given steps (`.step` set by the loop).
"""

from __future__ import annotations

import torch
from torch import nn

from hookprof.demo import InjectNonFinite


def StepInjector(module: nn.Module, at: set, value: float = float("nan")) -> InjectNonFinite:
    """`module`'s output times `value` while the injector's `.step` (set by the loop before
    the forward: a step number, or (step, call of the closure)) is in `at`."""
    return InjectNonFinite(module, at, value, count_calls=False)


class BadBatch:
    """`layer` makes a NaN whenever the batch in `.poisoned` runs through `model`: in its
    forward output (`where="forward"`), or in the gradient it receives in the backward only
    (`where="backward"`). `.current` is the batch the model's forward saw last."""

    def __init__(self, model: nn.Module, layer: nn.Module, where: str = "forward"):
        self.poisoned: torch.Tensor | None = None
        self.current: torch.Tensor | None = None
        model.register_forward_pre_hook(self._note)
        if where == "forward":
            layer.register_forward_hook(self._poison)
        else:
            layer.register_full_backward_pre_hook(self._poison_grad)

    def _note(self, module, args):
        self.current = args[0]

    def _is_poisoned(self) -> bool:
        """The batch now running is the poisoned one: the same values (a replay runs its
        forward on a copy of the step's inputs, as a real data-dependent NaN recurs)."""
        current, poisoned = self.current, self.poisoned
        if current is None or poisoned is None:
            return False
        return current is poisoned or (
            current.shape == poisoned.shape and torch.equal(current, poisoned)
        )

    def _poison(self, module, args, output):
        if self._is_poisoned():
            return output * float("nan")
        return None

    def _poison_grad(self, module, grad_output):
        if self._is_poisoned():
            return tuple(g * float("nan") if g is not None else None for g in grad_output)
        return None


class NanAt(nn.Module):
    """A layer that turns its (finite) input into NaN on the steps in `at`. Keyed by the step,
    which the loop (or Lightning's SetStep) writes before each batch, not by a call count: a
    replay of the step by hookprof reproduces the NaN, as it would a NaN that comes from the
    data or the weights."""

    def __init__(self, at: set[int]):
        super().__init__()
        self.at = set(at)
        self.step = 0

    def forward(self, x):
        return x + float("nan") if self.step in self.at else x
