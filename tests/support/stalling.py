"""Parts that stall on purpose, for the stall tests (single process and distributed)."""

from __future__ import annotations

import time

import torch
from torch import nn


class Sleeper(nn.Module):
    """A ReLU that, at step `at` (counted by its own training calls), blocks until `release`
    is set or `max_s` has passed."""

    def __init__(self, at: int, release, max_s: float = 30.0, started=None):
        super().__init__()
        self.at, self.release, self.max_s, self.started = at, release, max_s, started
        self.calls = 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at:
                if self.started is not None:
                    self.started(self.calls)
                self.release.wait(self.max_s)
        return torch.relu(x)


class SlowItems(torch.utils.data.Dataset):
    """Random batches; item `slow_at` takes `delay_s` (in a DataLoader worker)."""

    def __init__(self, n: int, slow_at: int, delay_s: float):
        self.n, self.slow_at, self.delay_s = n, slow_at, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow_at:
            time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return x, x.sum(dim=0, keepdim=True)
