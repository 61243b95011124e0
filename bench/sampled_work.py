"""Host cost of the work around a sampled step's hooks that is done once rather than per call
(docs/sampled-step-work.md), each part timed alone, best of many repetitions.

    python bench/sampled_work.py                            # this checkout
    python bench/sampled_work.py --against main --rounds 3  # main and this checkout, alternating

- layer call: what LayerHooks calls for a `forward(x)` layer call of a sampled step with
  FLOP counting on (StepEfficiency.note_call where a version has it, else what
  StepEfficiency.listen sets LayerHooks.on_call to);
- peak: StepEfficiency._peak at a sampled step's end, the device named as an H100 (its
  name function replaced: there is no GPU to ask; on CUDA the real call adds to main's);
- update measurement: UpdateNorms before + after an update, 80 x Linear(4, 4) (160
  parameters, small: the Python around the norms shows);
- counters read per fold: what History.observe reads of StepCounters (read() or latest()).

`--against` runs each version in its own process per round, alternating which goes first,
and prints the medians of the rounds side by side with their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("HOOKPROF_ROOT", ROOT), HERE]

import torch  # noqa: E402
from torch import nn  # noqa: E402

PARTS = (("layer_call_us", "layer call, forward(x), FLOP counting on"),
         ("peak_us", "peak lookup per sampled step (H100 name)"),
         ("update_us", "update measurement, 160 parameters"),
         ("counters_us", "step counters read per history fold"))


def best_us(fn, inner: int, reps: int) -> float:
    """Best over `reps` of the mean of `inner` calls of fn, in microseconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best / inner / 1e3


def efficiency(peak_flops: float | None):
    from hookprof.efficiency.figures import StepEfficiency
    from hookprof.layers import LayerTable
    from hookprof.notices import Notices

    return StepEfficiency(LayerTable(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), flops=True,
                          update_norms=False, update_max_bytes=0, peak_flops=peak_flops, notices=Notices())


def layer_call_us() -> float:
    eff = efficiency(1e12)
    if hasattr(eff, "listen"):
        hooks = types.SimpleNamespace(on_call=None)
        eff.listen(hooks)
        on_call = lambda: hooks.on_call  # noqa: E731  (changes after a step's first call)
    else:
        on_call = lambda: eff.note_call  # noqa: E731
    x = torch.randn(2, 4, requires_grad=True) * 1.0
    args = (x,)
    best = float("inf")
    for _ in range(40):
        on_call()(0, args, None, False)  # the step's first call
        call = on_call()
        t0 = time.perf_counter_ns()
        for _ in range(400):
            call(0, args, None, False)
        best = min(best, time.perf_counter_ns() - t0)
        eff.drop()
    return best / 400 / 1e3


def peak_us() -> float:
    from hookprof.efficiency import peaks

    peaks.device_name = lambda device: "NVIDIA H100 80GB HBM3"
    eff = efficiency(None)
    eff._precision = "bf16"
    return best_us(eff._peak, 1000, 50)


def update_us() -> float:
    from hookprof.layers import LayerTable
    from hookprof.efficiency.updates import UpdateNorms

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(80)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = UpdateNorms(LayerTable(model), 1 << 30)
    follow = getattr(norms, "follow", None)

    def measure():
        if follow is not None:
            follow(opt)
        norms.before_update()
        norms.after_update()

    measure()
    return best_us(measure, 20, 30)


def counters_us() -> float:
    from hookprof.step.record import StepCounters

    counters = StepCounters()
    for i in range(100):
        counters.observe(0.01 * (i % 7), float(i))
    return best_us(getattr(counters, "latest", counters.read), 10000, 20)


def run_here() -> dict:
    torch.set_num_threads(1)
    return {"layer_call_us": layer_call_us(), "peak_us": peak_us(), "update_us": update_us(),
            "counters_us": counters_us()}


def against(rev: str, rounds: int) -> dict[str, list[dict]]:
    from compare_versions import alternate

    return alternate(__file__, rev, rounds)


def print_table(runs: dict[str, list[dict]]) -> None:
    labels = list(runs)
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs; medians over {len(runs[labels[0]])} "
          "rounds of each process's best")
    print("| us | " + " | ".join(labels) + (" | ratio |" if len(labels) == 2 else " |"))
    print("|---|" + "---|" * (len(labels) + (len(labels) == 2)))
    for key, what in PARTS:
        medians = [statistics.median(r[key] for r in runs[lb]) for lb in labels]
        ratio = f" | {medians[1] / medians[0]:.2f}" if len(medians) == 2 else ""
        print(f"| {what} | " + " | ".join(f"{m:.3f}" for m in medians) + ratio + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="with --against: processes per version")
    parser.add_argument("--against", metavar="REV", help="also run a git revision (in a temporary worktree)")
    parser.add_argument("--json", help="write this process's numbers here")
    args = parser.parse_args(argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_here(), f)
        return 0
    print_table(against(args.against, args.rounds) if args.against else {"this checkout": [run_here()]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
