"""What an update ratio jump's verdict costs (Config.spike_replay with update_norms, issue 43):
on each step that measures updates, the optimizer's update of the turn's parameters run a
second time on copies (hookprof/integrity/update_replay.py) and compared bitwise.

Side by side in one run, rounds interleaved, on the workloads of bench/overhead.py under
AdamW: a bare training step, and the second run's own work on that step (the copies of the
parameters, gradients and AdamW's two moments, the shadow's update, the comparison; the
jump's gate reads the update norms' own sums, a few ops),
called directly around a real step, every parameter in the turn (the default cap,
update_norm_max_bytes, takes a quarter of them per measurement: this is the most one
measurement costs). Then amortised per step at the default update_norm_interval_s (1 s):
one measurement per second at most, so the cost per step is the measurement's extra over
the number of steps in a second.

    python bench/update_replay.py
    python bench/update_replay.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import WORKLOADS  # noqa: E402

from hookprof.integrity.update_replay import UpdateReplay  # noqa: E402
from hookprof.step import dispatch  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # hookprof's process-wide optimizer hooks, as attach puts them in: the second run
    # refuses to run where another tool's global hooks sit between them (none here)
    dispatch.listen()
    print(f"torch {torch.__version__}, device {device}, {args.rounds} rounds of {args.steps}")
    print("| workload | bare step | the second run's extra | extra / step | per step at 1 s |")
    print("|---|---|---|---|---|")
    for w in WORKLOADS.values():
        torch.manual_seed(0)
        model = w.build().to(device)
        g = torch.Generator().manual_seed(0)
        x = w.make_input(g).to(device)
        y = torch.randint(0, 10, (w.batch,), generator=g).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        params = list(model.parameters())
        replay = UpdateReplay(params, [n for n, _ in model.named_parameters()])
        turn = tuple(range(len(params)))

        def step(recheck: bool, n: int) -> float:
            started = time.perf_counter()
            for k in range(n):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                if recheck:
                    replay.update_began(k + 1, opt, turn, final=True)
                opt.step()
                if recheck:
                    replay.update_done()
                    sent = replay.step_ended(k + 1)
                    comparison = sent[0][0] if sent else None
                    if comparison is None or comparison.refused is not None:
                        raise SystemExit(f"the update was not run again: {comparison}")
            sync(device)
            return (time.perf_counter() - started) / n

        step(True, 3)  # warm-up, both ways
        step(False, 3)
        bare, checked = [], []
        for _ in range(args.rounds):
            bare.append(step(False, args.steps))
            checked.append(step(True, args.steps))
        b, c = statistics.median(bare), statistics.median(checked)
        extra = c - b
        # one measurement per second at most: its extra over a second's steps (or, for
        # steps longer than a second, over its own step)
        print(
            f"| {w.name} | {b * 1e3:.1f} ms | {extra * 1e3:.1f} ms | {extra / b:.2f} | "
            f"{extra / max(1.0, b):.1e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
