"""Memory over a long run: 5,000 steps of a small model with hookprof at its most active
setting (every step sampled, activation statistics on every step), printing resident memory,
live tensors and live Python objects after warm-up and then every 1,000 steps.

    python bench/memory.py                 # 5,000 steps, a table
    python bench/memory.py --json          # the same figures as one JSON line (used by a test)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings

import paths  # noqa: F401  (first: the hookprof under test, HOOKPROF_ROOT's or this checkout's)
import psutil
import torch
from torch import nn

import hookprof

MOST_ACTIVE = dict(
    port=0,
    sample_every=1,
    min_sample_interval_s=0.0,
    activation_interval_s=0.0,
    publish_interval_s=0.1,
    system_interval_s=0.5,
)


def live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance() on some library proxies warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def soak(steps: int, every: int, warmup: int) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.LayerNorm(128),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(128, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    me = psutil.Process()
    rows = []
    with hookprof.attach(model, **MOST_ACTIVE) as prof:
        for step in range(1, steps + 1):
            x = torch.randn(32, 64, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            prof.step(loss)
            if step == warmup or (step > warmup and step % every == 0):
                prof.flush()
                gc.collect()
                rows.append(
                    {
                        "step": step,
                        "rss_bytes": me.memory_info().rss,
                        "tensors": live_tensors(),
                        "objects": len(gc.get_objects()),
                        "sampled": prof.snapshot().sampled_steps,
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = soak(args.steps, args.every, args.warmup)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"# {args.steps} steps, hookprof sampling every step with activation statistics on every step"
    )
    print("| step | RSS (MiB) | live tensors | live Python objects | sampled steps |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['step']} | {r['rss_bytes'] / 2**20:.1f} | {r['tensors']} | {r['objects']} "
            f"| {r['sampled']} |"
        )
    first, last = rows[0], rows[-1]
    print(
        f"\nafter warm-up: RSS {(last['rss_bytes'] - first['rss_bytes']) / 2**20:+.1f} MiB, "
        f"tensors {last['tensors'] - first['tensors']:+d}, objects {last['objects'] - first['objects']:+d}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
