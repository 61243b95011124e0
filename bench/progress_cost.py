"""What the progress record costs the training thread per step: the stores a plain step makes
at its boundaries (root forward, root output, optimizer pre and post, step end), side by side
with an empty loop of the same shape and with the clock reads alone, in one run; and what a
sampled step on CUDA adds to them: a device-timer mark per boundary (device_phases.py), here
the real CudaEventTimer over tests/fake_gpu.py's stand-in events (their record() is Python,
a real one is a C call: ~3 us on an H100 with the stream passed, DESIGN.md), including
handing the 5 events back to the timer's pool, which the publisher thread does in real use.

    python bench/progress_cost.py

The full picture (a real model, with and without hookprof) is bench/compare_versions.py.
"""

from __future__ import annotations

import statistics
import time

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from fake_gpu import FakeEvent, FakeStream  # noqa: E402
from hookprof.phases.device import PhaseMarks  # noqa: E402
from hookprof.phases.clock import BACKWARD, FORWARD, OPTIMIZER, OTHER, Progress  # noqa: E402
from hookprof.step.record import StepRecord  # noqa: E402
from hookprof.device.timing import CudaEventTimer  # noqa: E402


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


def progress_stores_with_device_marks(steps: int) -> None:
    clock = time.perf_counter_ns
    stream = FakeStream()
    timer = CudaEventTimer(event_factory=FakeEvent, current_stream=lambda: stream)
    marks = PhaseMarks(Progress(clock()), timer)
    record = marks.bind(StepRecord(timer.start())).record
    for number in range(1, steps + 1):
        marks.enter(FORWARD, clock())
        marks.enter(BACKWARD, clock())
        marks.enter(OPTIMIZER, clock())
        marks.enter(OTHER, clock())
        marks.end_step(number, clock())
        timer.release([t for _, t in record.phase_marks])
        record.phase_marks.clear()


def main() -> None:
    base = per_step_ns(empty)
    clocks = per_step_ns(clock_reads) - base
    stores = per_step_ns(progress_stores) - base
    print(f"{'per step':<34}{'ns':>10}")
    print(f"{'5 clock reads':<34}{clocks:>10.0f}")
    print(f"{'5 clock reads + progress stores':<34}{stores:>10.0f}")
    print(f"{'progress stores alone':<34}{stores - clocks:>10.0f}")
    marked = per_step_ns(progress_stores_with_device_marks, steps=50_000) - base
    print(f"{'... + 5 device marks (stand-ins)':<34}{marked:>10.0f}")
    print(f"{'device marks alone, per boundary':<34}{(marked - stores) / 5:>10.0f}")


if __name__ == "__main__":
    main()
