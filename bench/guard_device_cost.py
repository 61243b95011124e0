"""What the NaN/Inf policies cost per unsampled step on a device that runs behind the host,
emulated on the CPU (tests/lagging_device.py: output, loss and gradient checks stay device
flags, one-value copies arrive `--lag` steps late), so the accelerator code paths of the
update guard and the forward replay run here:

    python bench/guard_device_cost.py                 # this checkout
    python bench/guard_device_cost.py --against main  # main and this checkout side by side

Per configuration (policy, optimizer, nonfinite_sync), printed:
- ops: the ATen ops hookprof adds to one unsampled step (with it, less without it, on
  copies of one model), each a kernel launch on a GPU;
- waits: the training thread's waits for the device per step, as the emulation sees them
  (a version whose guard read its flag with a bare bool(), before the seam in
  transfer.read_now, made one more than it shows on the nonfinite_sync rows);
- us: host CPU microseconds spent in hookprof's step-boundary methods per unsampled step
  (bench/host_cost.py's BoundaryMeter; the thread's CPU time, torch on one thread).

The gradients take their accelerator path (one fused reduction, not a CPU dot per tensor).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("HOOKPROF_ROOT", ROOT), HERE, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import hookprof  # noqa: E402
from host_cost import BoundaryMeter, against  # noqa: E402
from lagging_device import lagging_device  # noqa: E402
from models import DeepNet, loss_of, seeded  # noqa: E402
from op_counter import OpCounter  # noqa: E402

RARELY = dict(port=0, sample_every=1000, min_sample_interval_s=3600.0)  # step 1 only

CONFIGS = {  # label: (on_nonfinite, optimizer, nonfinite_sync)
    "record, SGD": ("record", "sgd", False),
    "skip, SGD": ("skip", "sgd", False),
    "skip, fused Adam": ("skip", "fused", False),
    "skip, SGD, nonfinite_sync": ("skip", "sgd", True),
    "record, SGD, nonfinite_sync": ("record", "sgd", True),
}


def make_opt(kind: str, model) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.Adam(model.parameters(), lr=0.0, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step is the same step


def one_step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    opt.step()


def measure(label: str, depth: int, steps: int, lag: int) -> dict:
    policy, kind, sync = CONFIGS[label]
    base = seeded(DeepNet, depth=depth)
    batch = base.batch(torch.Generator().manual_seed(0))
    bare, watched = base, copy.deepcopy(base)
    bare_opt, watched_opt = make_opt(kind, bare), make_opt(kind, watched)
    meter = BoundaryMeter(clock=__import__("time").thread_time_ns)
    meter.install()
    try:
        with lagging_device(lag) as device:
            prof = hookprof.attach(watched, **RARELY, on_nonfinite=policy, nonfinite_sync=sync)
            try:
                for _ in range(3):  # step 1 is sampled; step 2 builds the cached plans
                    one_step(bare, bare_opt, batch)
                    one_step(watched, watched_opt, batch)
                with OpCounter() as counter:
                    one_step(watched, watched_opt, batch)
                with_ops = counter.ops
                with OpCounter() as counter:
                    one_step(bare, bare_opt, batch)
                ops = sum((with_ops - counter.ops).values())
                waits_before = device.waits.count("MainThread")
                per_step_us = []
                for _ in range(steps):
                    meter.ns = 0
                    one_step(watched, watched_opt, batch)
                    per_step_us.append(meter.ns / 1e3)
                waits = (device.waits.count("MainThread") - waits_before) / steps
            finally:
                prof.detach()
    finally:
        meter.remove()
    return {"config": label, "ops": ops, "waits": waits, "us": statistics.median(per_step_us)}


def run_here(args) -> dict:
    torch.set_num_threads(1)  # every op on the timed thread
    gradients = sys.modules.get("hookprof.step.gradients")
    if hasattr(getattr(gradients, "GradientNorms", None), "cpu_dot_per_tensor"):
        gradients.GradientNorms.cpu_dot_per_tensor = False  # the accelerator's reduction, as on a GPU
    return {"depth": args.depth, "rows": [measure(label, args.depth, args.steps, args.lag)
                                          for label in CONFIGS]}


def table(results: list[tuple[str, dict]]) -> str:
    head = "| configuration | " + " | ".join(f"{lb}: ops | waits/step | us" for lb, _ in results) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(results)]
    for label in CONFIGS:
        cells = []
        for _, r in results:
            row = next(x for x in r["rows"] if x["config"] == label)
            cells += [str(row["ops"]), f"{row['waits']:.2f}", f"{row['us']:.0f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8, help="DeepNet blocks")
    parser.add_argument("--steps", type=int, default=200, help="timed unsampled steps per configuration")
    parser.add_argument("--lag", type=int, default=3, help="optimizer steps the device runs behind")
    parser.add_argument("--against", metavar="REV", help="also run a git revision (in a temporary worktree)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    print(f"# guard cost on an emulated device {args.lag} steps behind: torch {torch.__version__}, "
          f"DeepNet depth {args.depth}, {args.steps} steps", flush=True)
    if args.against:
        results = against(args, argv, script=__file__)
    else:
        results = [("this checkout", run_here(args))]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results[0][1], f, indent=2)
            return 0
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
