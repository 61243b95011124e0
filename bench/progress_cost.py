"""What the progress record costs the training thread per step: the stores a plain step makes
at its boundaries (root forward, root output, optimizer pre and post, step end), side by side
with an empty loop of the same shape and with the clock reads alone, in one run.

    python bench/progress_cost.py

The full picture (a real model, with and without hookprof) is bench/compare_versions.py.
"""

from __future__ import annotations

import statistics
import time

from hookprof.progress import BACKWARD, FORWARD, OPTIMIZER, OTHER, Progress


def per_step_ns(body, steps: int = 200_000, rounds: int = 7) -> float:
    results = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        body(steps)
        results.append((time.perf_counter_ns() - t0) / steps)
    return statistics.median(results)


def empty(steps: int) -> None:
    for _ in range(steps):
        pass


def clock_reads(steps: int) -> None:
    clock = time.perf_counter_ns
    for _ in range(steps):
        clock(), clock(), clock(), clock(), clock()


def progress_stores(steps: int) -> None:
    clock = time.perf_counter_ns
    progress = Progress(clock())
    for number in range(1, steps + 1):
        progress.enter(FORWARD, clock())
        progress.enter(BACKWARD, clock())
        progress.enter(OPTIMIZER, clock())
        progress.enter(OTHER, clock())
        progress.end_step(number, clock())


def main() -> None:
    base = per_step_ns(empty)
    clocks = per_step_ns(clock_reads) - base
    stores = per_step_ns(progress_stores) - base
    print(f"{'per step':<34}{'ns':>10}")
    print(f"{'5 clock reads':<34}{clocks:>10.0f}")
    print(f"{'5 clock reads + progress stores':<34}{stores:>10.0f}")
    print(f"{'progress stores alone':<34}{stores - clocks:>10.0f}")


if __name__ == "__main__":
    main()
