"""What the torch.compile tests and benches share: Dynamo's count of what it compiled, and
a residual model whose first layer overflows on a bad input row."""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.utils import counters


def compiled_so_far() -> int:
    """Frames and graphs Dynamo has compiled in this process: its "frames" counter alone
    misses fullgraph=True (that path bypasses it), "unique_graphs" counts every graph."""
    return counters["frames"]["total"] + counters["stats"]["unique_graphs"]


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Linear(2 * width, width),
        )

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class OverflowNet(nn.Module):
    """`inp` (its weights scaled up, so a row of ~3e38 overflows there), then `depth`
    residual blocks (the repeated blocks regional compilation compiles one by one), `out`."""

    def __init__(self, inputs: int = 8, width: int = 16, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        with torch.no_grad():
            self.inp.weight.mul_(10)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def dynamo_counts() -> tuple[int, int, int]:
    """(graph breaks, frames and graphs compiled, CUDA-graph skips) so far."""
    return (
        sum(counters["graph_break"].values()),
        compiled_so_far(),
        counters["inductor"]["cudagraph_skips"],
    )


def overflow_run(
    compile_model,
    *,
    attach: bool,
    device: str,
    net: dict,
    batch: int,
    steps: int,
    bad_step: int,
    settings: dict,
):
    """Train OverflowNet(**net) on `device`, `compile_model(model)` what the loop calls, with
    a row that overflows `inp` in the batch of `bad_step`; hookprof attached (`settings`)
    before compiling when `attach`. Returns (parameters, snapshot or None, Dynamo's counts:
    graph breaks, frames and graphs compiled after step 2, CUDA-graph skips)."""
    import hookprof

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = OverflowNet(**net).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = hookprof.attach(model, **settings) if attach else None
    call = compile_model(model)
    gen = torch.Generator(device=device).manual_seed(1)
    try:
        for step in range(1, steps + 1):
            x = torch.randn(batch, net.get("inputs", 8), device=device, generator=gen)
            if step == bad_step:
                x[0] = 3e38
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            opt.step()
            if step == 2:
                warm = dynamo_counts()
        if device == "cuda":
            torch.cuda.synchronize()
        end = dynamo_counts()
        after = (end[0], end[1] - warm[1], end[2])
        snap = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
        return [p.detach().clone() for p in model.parameters()], snap, after
    finally:
        if prof is not None:
            prof.detach()
