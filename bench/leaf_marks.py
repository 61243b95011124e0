"""Timer marks (CUDA event records on a GPU), hook calls and Python function calls per
instrumented leaf on one sampled step, for the four workload shapes of issue 13
(bench/shapes.py, narrow sizes: the counts do not depend on width). Deterministic: marks
are counted with tests/fake_gpu.py's stand-in events, Python calls with cProfile's count
(one sampled step - one unsampled step, the same profiler), so it runs on a CPU, needs no
repetition and is not moved by a loaded machine.

    python bench/leaf_marks.py
    HOOKPROF_ROOT=/path/to/other/checkout python bench/leaf_marks.py   # another version
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("HOOKPROF_ROOT", ROOT), HERE, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import shapes  # noqa: E402
from mark_counter import count_sampled_step  # noqa: E402


def python_calls_per_leaf(name: str) -> tuple[float, float]:
    """(all Python function calls, hookprof's own) per leaf: a sampled step's count minus an
    unsampled one's, divided by the leaves."""
    import hookprof

    shape = shapes.build(name, torch.device("cpu"), full=False)
    prof = hookprof.attach(shape.model, port=0, sample_every=2, min_sample_interval_s=0.0, summary_at_exit=False)
    counts: dict[bool, tuple[int, int]] = {}
    try:
        for _ in range(6):  # warm-up: hooks installed, FLOPs of each signature counted
            shape.step()
        while len(counts) < 2:
            sampled = prof._plan.sampled
            profile = cProfile.Profile()
            profile.enable()
            shape.step()
            profile.disable()
            stats = pstats.Stats(profile, stream=io.StringIO())
            own = sum(v[1] for k, v in stats.stats.items() if f"{os.sep}hookprof{os.sep}" in k[0])
            counts[sampled] = (stats.total_calls, own)
        leaves = len(prof.table)
    finally:
        prof.detach()
    return ((counts[True][0] - counts[False][0]) / leaves, (counts[True][1] - counts[False][1]) / leaves)


def main() -> int:
    print("| workload | leaves | forward calls | layer marks | marks/leaf | forward | outer | node pre-hooks "
          "| param hooks | step phase marks | hook calls/leaf | Python calls/leaf (hookprof's) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes.NAMES:
        if name == "hf-gpt2" and not shapes.hf_available():
            continue
        shape = shapes.build(name, torch.device("cpu"), full=False)
        c = count_sampled_step(shape.model, shape.step)
        py_all, py_own = python_calls_per_leaf(name)
        print(f"| {shape.name} | {c.layers} | {c.forward_calls} | {c.layer_marks} | {c.marks_per_leaf:.2f} "
              f"| {c.forward_marks} | {c.outer_marks} | {c.node_marks} | {c.param_marks} | {c.step_marks} "
              f"| {c.hook_calls / c.layers:.2f} | {py_all:.1f} ({py_own:.1f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
