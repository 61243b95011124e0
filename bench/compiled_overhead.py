"""What hookprof adds to a compiled training step, measured side by side in one run.

    python bench/compiled_overhead.py                  # aot_eager and inductor, ~3 min on 2 CPU cores
    python bench/compiled_overhead.py --quick          # a smoke run
    python bench/compiled_overhead.py --device cuda    # on a GPU

Under torch.compile hookprof's model-output check is traced into the graph (one
`isfinite().all()` of the output, two counter writes) and taken eagerly at the update (a
`gt` and a `zero_` on two int32 values); the step counters and the optimizer hooks run as on
an eager model. This script trains the same MLP (8 x Linear(512), GELU, batch 256) compiled
whole and block by block (regional compilation), without hookprof, attached with the
defaults, and attached sampling every step with activation checks (each sampled step's
forward re-run eagerly for the per-layer statistics), each with its own copy of the model, in
interleaved rounds (rotating order) so
that machine noise hits both alike. It prints the median step time per configuration and
two ratios to "none": of the medians, and the median of each round's ratio to the "none"
round beside it. Dynamo's graph breaks and frames and graphs compiled while warming up are printed for each,
and those compiled during the measured rounds (0: nothing recompiled).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paths  # noqa: E402,F401  (first: the hookprof under test)
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import hookprof  # noqa: E402
from support.compiled import compiled_so_far  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc, self.act = nn.Linear(width, width), nn.GELU()

    def forward(self, x):
        return x + self.act(self.fc(x))


class Mlp(nn.Module):
    def __init__(self, width: int = 512, depth: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# no hookprof; the defaults; every step sampled with activation checks (each one's forward
# re-run eagerly for the per-layer statistics: the most that costs)
CONFIGS = ("none", "hookprof", "every step")


class Run:
    """One configuration: its own model, optimizer and compiled callable."""

    def __init__(self, config: str, how: str, backend: str, device: str):
        torch.manual_seed(0)
        self.model = Mlp().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        every = dict(sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)
        self.prof = (
            None
            if config == "none"
            else hookprof.attach(
                self.model,
                port=0,
                summary_at_exit=False,
                system_metrics=False,
                **(every if config == "every step" else {}),
            )
        )
        if how == "whole":
            self.call = torch.compile(self.model, backend=backend)
        else:
            for block in self.model.blocks:
                block.compile(backend=backend)
            self.call = self.model
        self.x = torch.randn(256, 512, device=device)
        self.device = device

    def steps(self, n: int) -> float:
        """Mean seconds per step over n steps."""
        self._sync()
        start = time.perf_counter()
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            self.call(self.x).square().mean().backward()
            self.opt.step()
        self._sync()
        return (time.perf_counter() - start) / n

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.detach()


def measure(how: str, backend: str, device: str, rounds: int, steps: int) -> None:
    runs = {}
    dynamo = {}
    torch._dynamo.reset()  # once: a reset between the two would drop the first one's graphs
    for name in CONFIGS:
        counters.clear()
        run = Run(name, how, backend, device)
        run.steps(3)  # compile and warm up
        dynamo[name] = (sum(counters["graph_break"].values()), compiled_so_far())
        runs[name] = run
    counters.clear()
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(runs[name].steps(steps))
    recompiled = compiled_so_far()  # during the measured rounds: 0 expected
    for run in runs.values():
        run.close()
    base = statistics.median(times["none"])
    print(
        f"| {how} | {backend} | none | {base * 1e3:.2f} | 1.000 | 1.000 | "
        f"{dynamo['none'][0]} / {dynamo['none'][1]} |"
    )
    for name in CONFIGS[1:]:
        t = times[name]
        paired = statistics.median(a / b for a, b in zip(t, times["none"]))
        print(
            f"| {how} | {backend} | {name} | {statistics.median(t) * 1e3:.2f} | "
            f"{statistics.median(t) / base:.3f} | {paired:.3f} | "
            f"{dynamo[name][0]} / {dynamo[name][1]} |"
        )
    print(
        f"|  |  | frames and graphs compiled during the measured rounds: {recompiled} |  |  |  |  |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backends", default="aot_eager,inductor")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rounds, steps = (2, 3) if args.quick else (12, 20)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(
        f"torch {torch.__version__}, {args.device}, {rounds} rounds x {steps} steps, "
        f"hookprof {hookprof.__version__}"
    )
    print(
        "\n| compiled | backend | config | median step ms | ratio of medians | paired ratio | "
        "graph breaks / frames and graphs compiled |\n|---|---|---|---|---|---|---|"
    )
    for backend in args.backends.split(","):
        for how in ("whole", "regional"):
            measure(how, backend, args.device, rounds, steps)


if __name__ == "__main__":
    main()
