"""Where the cost of a sampled step goes: every-step sampling with parts switched off, side
by side in one run (same method as overhead.py).

    python bench/breakdown.py --workload mlp

Parts are switched off through internals, not public settings: this is a measuring tool.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

from overhead import WORKLOADS, Runner, workload_data

EVERY = dict(sample_every=1, min_sample_interval_s=0.0)


def switch_off(prof, part: str) -> None:
    if part in ("no gradient norms", "hooks only"):
        prof._gradients.layer_squares = lambda: ([], frozenset())
    if part == "no zero ratio":
        prof._hooks._zero_ratio = [False] * len(prof._hooks._zero_ratio)


CONFIGS = {
    "none": None,
    "every step": EVERY,
    "no zero ratio": EVERY,
    "no activation stats": dict(EVERY, activation_stats=False),
    "no gradient norms": EVERY,
    "hooks only": dict(EVERY, activation_stats=False),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="mlp", choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    w, base, x, y = workload_data(args.workload)
    runners = []
    for name, overrides in CONFIGS.items():
        r = Runner(name, copy.deepcopy(base), x, y)
        if overrides is not None:
            r.attach(overrides)
            switch_off(r.prof, name)
        runners.append(r)
    try:
        for r in runners:
            r.timed_round(3)
            r.round_means.clear()
        for i in range(args.rounds):
            for r in runners[i % len(runners):] + runners[: i % len(runners)]:
                r.timed_round(args.steps)
    finally:
        for r in runners:
            if r.prof is not None:
                r.prof.detach()
    base_s = statistics.median(runners[0].round_means)
    print(f"# {w.name}: {args.rounds} rounds x {args.steps} steps")
    for r in runners:
        m = statistics.median(r.round_means)
        print(f"{r.config:22s} {m * 1e3:7.2f} ms  {m / base_s:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
