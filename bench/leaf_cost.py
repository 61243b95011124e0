"""Host time per instrumented leaf of a sampled step's per-layer hooks, split into forward
and backward, for a deep narrow MLP (Linear + ReLU) and a small conv net (Conv2d +
BatchNorm2d + ReLU): hookprof's Python and torch's hook dispatch, with as little compute
around it as a model can have; and the hooks' own calls timed alone (no model around them:
steadier on a loaded machine).

    python bench/leaf_cost.py                              # this checkout
    python bench/leaf_cost.py --against main --rounds 6    # main and this checkout, alternating

In one process the same model runs bare and with hookprof attached (sampled every step),
step after step in turn, so that the machine's load falls on both alike; per leaf is
(20th percentile with hookprof - 20th percentile bare) / leaves, in the thread's CPU time,
forward (the hooks of every call, the root module's hooks, the registration of the
backward marks) and backward (the node pre-hooks) apart. On a CPU the timer is the host
clock (~0.06 us a mark); on CUDA each mark is an event record (~3 us on an H100, not
counted here: `bench/leaf_marks.py` counts them). `--against` runs each version in its own
processes, alternating which goes first, and prints the medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("HOOKPROF_ROOT", ROOT), HERE]

import torch  # noqa: E402
from torch import nn  # noqa: E402

DEPTH = 60  # blocks per model


def mlp() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(8, 8), nn.ReLU())]), torch.randn(2, 8)


def convnet() -> tuple[nn.Module, torch.Tensor]:
    blocks = [m for _ in range(DEPTH) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]
    return nn.Sequential(*blocks), torch.randn(1, 4, 4, 4)


MODELS = {"mlp": mlp, "convnet": convnet}


def measure(name: str, steps: int, flop_counting: bool) -> dict:
    """Per-leaf forward and backward microseconds of one model, in this process."""
    import hookprof

    torch.set_num_threads(1)
    torch.manual_seed(0)
    bare, x = MODELS[name]()
    torch.manual_seed(0)
    hooked, _ = MODELS[name]()
    # sampled every step; the periodic extras (activation statistics, update norms) off, so
    # that every step is the same and the figure is the hooks'
    prof = hookprof.attach(hooked, port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=1e9,
                           update_norms=False, system_metrics=False, summary_at_exit=False,
                           flop_counting=flop_counting)
    clock = time.thread_time_ns
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.0) for m in (bare, hooked)}
    times: dict[nn.Module, tuple[list[int], list[int]]] = {bare: ([], []), hooked: ([], [])}
    try:
        for i in range(steps + 5):
            for model in (bare, hooked):
                opts[model].zero_grad(set_to_none=True)
                t0 = clock()
                loss = model(x).sum()
                t1 = clock()
                loss.backward()
                t2 = clock()
                opts[model].step()
                if i >= 5:  # warm-up: the first sampled step installs the hooks
                    times[model][0].append(t1 - t0)
                    times[model][1].append(t2 - t1)
        leaves = len(prof.table)
    finally:
        prof.detach()

    def p20(values: list[int]) -> float:
        return sorted(values)[len(values) // 5] / 1e3

    fwd = (p20(times[hooked][0]) - p20(times[bare][0])) / leaves
    bwd = (p20(times[hooked][1]) - p20(times[bare][1])) / leaves
    return {"model": name, "leaves": leaves, "flop_counting": flop_counting,
            "forward_us_per_leaf": fwd, "backward_us_per_leaf": bwd, "us_per_leaf": fwd + bwd}


def measure_calls(calls: int = 400, reps: int = 30) -> dict:
    """The hooks' own Python per layer call, without a model around it: LayerHooks' start and
    end of a call (what the forward wrapper calls) on a chain of tensors with distinct
    autograd nodes, then the registration of their backward marks (mark_pending); and
    FlopCounter.note for forward(x). Best of `reps`, in microseconds per call."""
    from hookprof.faults import Faults
    from hookprof.efficiency.flops import FlopCounter
    from hookprof.step.hooks import LayerHooks
    from hookprof.layers import LayerTable
    from hookprof.step.record import StepRecord
    from hookprof.device.timing import CpuTimer

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    table = LayerTable(model)
    hooks = LayerHooks(table, CpuTimer(), Faults(), activation_stats=False)
    end = getattr(hooks, "_end", hooks._leave)  # what the forward wrapper calls
    clock = time.perf_counter_ns
    best_calls = best_register = best_note = float("inf")
    for _ in range(reps):
        chain = [torch.randn(2, 4, requires_grad=True) * 1.0]
        for _ in range(calls):
            chain.append(chain[-1] * 1.0)  # each with its own autograd node
        hooks.begin(StepRecord(0), install=False)
        hooks.root_forward_began(True)
        t0 = clock()
        for k in range(calls):
            if hooks._enter(0, (chain[k],), None):
                end(0, chain[k + 1])
        t1 = clock()
        hooks.root_output_arrived()  # registers the noted marks, one pre-hook per node
        t2 = clock()
        hooks.end()
        best_calls = min(best_calls, t1 - t0)
        best_register = min(best_register, t2 - t1)
    flops = FlopCounter(table)
    x = chain[1]
    for _ in range(reps):
        t0 = clock()
        for _ in range(calls):
            flops.note(0, (x,), None, False)
        best_note = min(best_note, clock() - t0)
        flops.drop()
    return {"enter_leave_us": best_calls / calls / 1e3, "mark_pending_us": best_register / calls / 1e3,
            "flops_note_us": best_note / calls / 1e3}


def run_here(steps: int) -> list[dict]:
    rows = [measure(name, steps, flops) for name in MODELS for flops in (False, True)]
    return rows + [dict(measure_calls(), model="calls")]


def against(rev: str, rounds: int, steps: int) -> dict[str, list[list[dict]]]:
    """This script in its own process per version and round, alternating which goes first."""
    from compare_versions import alternate

    return alternate(__file__, rev, rounds, ["--steps", str(steps)])


def print_table(runs: dict[str, list[list[dict]]]) -> None:
    labels = list(runs)
    print("| model, FLOP counting | " + " | ".join(
        f"forward us/leaf ({lb}) | backward us/leaf ({lb}) | total ({lb})" for lb in labels) + " |")
    print("|---|" + "---|---|---|" * len(labels))
    first = runs[labels[0]][0]
    for i, row in enumerate(first):
        if row["model"] == "calls":
            continue
        cells = []
        for lb in labels:
            for key in ("forward_us_per_leaf", "backward_us_per_leaf", "us_per_leaf"):
                cells.append(f"{statistics.median(r[i][key] for r in runs[lb]):.2f}")
        flops = "on" if row["flop_counting"] else "off"
        print(f"| {row['model']} ({row['leaves']} leaves), {flops} | " + " | ".join(cells) + " |")
    print(f"\n(medians over {len(runs[labels[0]])} rounds)\n")
    print("| per layer call, no model around it (best of 30) | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for key, what in (("enter_leave_us", "start + end of a call (us)"),
                      ("mark_pending_us", "registering its backward mark (us)"),
                      ("flops_note_us", "FlopCounter.note, forward(x) (us)")):
        cells = [f"{statistics.median(r[-1][key] for r in runs[lb]):.2f}" for lb in labels]
        print(f"| {what} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="measured steps per model and variant")
    parser.add_argument("--rounds", type=int, default=4, help="with --against: processes per version")
    parser.add_argument("--against", metavar="REV", help="also run a git revision (in a temporary worktree)")
    parser.add_argument("--json", help="write this process's numbers here")
    args = parser.parse_args(argv)
    if args.against:
        print_table(against(args.against, args.rounds, args.steps))
        return 0
    rows = run_here(args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return 0
    print_table({"this checkout": [rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
