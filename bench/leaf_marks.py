"""Timer marks (CUDA event records on a GPU) and hook calls per instrumented leaf on one
sampled step, for the four workload shapes of issue 13 (bench/shapes.py, narrow sizes: the
counts do not depend on width). Deterministic: counted with tests/fake_gpu.py's stand-in
events, so it runs on a CPU and needs no repetition.

    python bench/leaf_marks.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("HOOKPROF_ROOT", ROOT), HERE, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import shapes  # noqa: E402
from mark_counter import count_sampled_step  # noqa: E402


def main() -> int:
    print("| workload | leaves | forward calls | layer marks | marks/leaf | forward | outer | node pre-hooks "
          "| param hooks | step phase marks | hook calls/leaf |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes.NAMES:
        if name == "hf-gpt2" and not shapes.hf_available():
            continue
        shape = shapes.build(name, torch.device("cpu"), full=False)
        c = count_sampled_step(shape.model, shape.step)
        print(f"| {shape.name} | {c.layers} | {c.forward_calls} | {c.layer_marks} | {c.marks_per_leaf:.2f} "
              f"| {c.forward_marks} | {c.outer_marks} | {c.node_marks} | {c.param_marks} | {c.step_marks} "
              f"| {c.hook_calls / c.layers:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
