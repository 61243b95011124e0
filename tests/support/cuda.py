"""For the tests that run on a real GPU (marked cuda): a transformer-shaped model and its
optimizer, the step a NaN is put in, and the check that makes any host-device sync raise."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

BAD_STEP = 23  # the step whose batch makes a NaN in the GPU NaN-guard tests


class Net(nn.Module):
    """A small transformer-shaped MLP stack: enough layers for attribution to mean something."""

    def __init__(self, width: int = 256, depth: int = 6):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def setup(fused=True):
    """Net on the GPU (seed 0) and its AdamW, fused or for-each."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True})
    )
    return model, opt


@contextlib.contextmanager
def no_sync(*, drain_first: bool = False):
    """Any host-device sync in the block raises (torch.cuda.set_sync_debug_mode is global:
    it covers hookprof's threads too). `drain_first`: wait for the device before, so that
    work queued earlier is not what is judged."""
    if drain_first:
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
