"""Where a synchronised job's fast ranks wait for a straggler, in hookprof's step phases.

    python bench/straggler_wait_phase.py                      # every set-up, data and forward slowed
    python bench/straggler_wait_phase.py --setups ddp --slow data --delay 0.05

Runs 2 gloo ranks on the CPU (tests/workers/ddp_straggler_worker.py: DDP or FSDP2, rank 1 sleeping
`--delay` seconds per step in one phase), reads both ranks' /metrics twice `--seconds` apart
and prints each rank's mean step time and mean time per step in each phase over that window.
The phase where rank 0's time grows by about the delay is where it waits; the phase the
straggler rules can compare is the one where only rank 1's grows (docs/efficiency.md). A
measurement of behaviour, not of speed: the phase a wait lands in does not depend on load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

import paths  # noqa: F401  (first: the hookprof under test, HOOKPROF_ROOT's or this checkout's, and the tests' helpers)
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families

from support.ports import free_port, free_port_range
from support.ranks import join_or_kill
from workers.ddp_straggler_worker import SETUPS, run_rank

PHASES = ("data", "forward", "backward", "optimizer", "other")


def totals(url: str) -> dict[str, tuple[float, float]]:
    """{phase or "step": (seconds, steps)} from one /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("hookprof_step_phase_seconds", "hookprof_step_duration_seconds"):
            continue
        for s in family.samples:
            key = s.labels.get("phase", "step")
            if s.name.endswith("_sum"):
                sums[key] = s.value
            elif s.name.endswith("_count"):
                counts[key] = s.value
    return {k: (sums[k], counts[k]) for k in sums}


def measure(setup: str, slow: str, delay: float, seconds: float) -> dict[int, dict[str, float]]:
    """{rank: {phase or "step": mean ms per step over the window}}."""
    ctx = mp.get_context("spawn")
    out, go_home, stop_at = ctx.Queue(), ctx.Event(), ctx.Value("i", 0)
    master = free_port()
    base = free_port_range(2, avoid=(master,))
    workers = [
        ctx.Process(
            target=run_rank,
            args=(r, 2, master, base, (0.0, delay), slow, out, go_home, stop_at, setup),
        )
        for r in range(2)
    ]
    for w in workers:
        w.start()
    try:
        urls = dict(out.get(timeout=120) for _ in range(2))
        time.sleep(1.0)  # past the first steps
        before = {r: totals(u) for r, u in urls.items()}
        time.sleep(seconds)
        after = {r: totals(u) for r, u in urls.items()}
    finally:
        go_home.set()
        join_or_kill(workers)
    return {
        r: {
            k: 1000
            * (after[r][k][0] - before[r][k][0])
            / max(1.0, after[r][k][1] - before[r][k][1])
            for k in after[r]
        }
        for r in urls
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument(
        "--slow", nargs="*", default=["data", "forward"], choices=["data", "forward", "other"]
    )
    parser.add_argument(
        "--delay", type=float, default=0.05, help="rank 1's sleep per step, seconds"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"rank 1 sleeps {args.delay * 1000:.0f} ms per step in the slowed phase; mean ms per step"
    )
    print(f"| set-up | slowed | rank | step | {' | '.join(PHASES)} | rank 0 waits in |")
    print("|---|---|---|---|" + "---|" * len(PHASES) + "---|")
    for setup in args.setups:
        for slow in args.slow:
            ms = measure(setup, slow, args.delay, args.seconds)
            # the phase where rank 0 spends the most more than rank 1: its wait; none by half
            # the delay: it waits in the slowed phase itself, which then looks alike on both
            waits = max(PHASES, key=lambda p: ms[0].get(p, 0) - ms[1].get(p, 0))
            if ms[0].get(waits, 0) - ms[1].get(waits, 0) < 500 * args.delay:
                waits = f"{slow} too (alike)"
            for rank in (0, 1):
                row = " | ".join(f"{ms[rank].get(p, 0):.1f}" for p in PHASES)
                print(
                    f"| {setup} | {slow} | {rank} | {ms[rank]['step']:.1f} | {row} | "
                    f"{waits if rank == 0 else ''} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
