"""Running one step's forward again, to find the layer that produced a NaN/Inf on a step
that had no per-layer checks.

Every training forward keeps a reference to the root module's inputs and the RNG state at
its start (a few microseconds). When the step's output turns out non-finite, the same forward
runs once more under `torch.no_grad()` with the per-layer checks installed, the same RNG
state (so dropout draws the same masks) and the same, not yet updated, parameters; buffers
such as BatchNorm's running statistics and the RNG are put back afterwards, so training goes
on exactly as it would have. This happens at most once per run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ForwardReplay:
    def __init__(self, model: nn.Module):
        self.model = model
        self.args: tuple | None = None
        self.kwargs: dict | None = None
        self._cpu_rng: torch.Tensor | None = None
        self._cuda_rng: list[torch.Tensor] | None = None
        self.done = False

    def capture(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def clear(self) -> None:
        self.args = self.kwargs = None

    def run(self, hooks: Any, rec: Any) -> bool:
        """Replay the captured forward into `rec` through `hooks`. False if nothing to replay."""
        if self.args is None or self.done:
            return False
        self.done = True
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self._cuda_rng is not None else None
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        installed = hooks.installed
        stats_were_on = hooks.activation_stats
        try:
            torch.set_rng_state(self._cpu_rng)
            if self._cuda_rng is not None:
                torch.cuda.set_rng_state_all(self._cuda_rng)
            hooks.replaying = True
            hooks.activation_stats = True  # the output checks are what the replay is for
            hooks.begin(rec)
            with torch.no_grad():
                self.model(*self.args, **(self.kwargs or {}))
        finally:
            hooks.replaying = False
            hooks.activation_stats = stats_were_on
            if installed:
                hooks.end()
            else:
                hooks.remove()
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            self.clear()
        return True
