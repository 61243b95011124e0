"""What of hookprof still works on a model compiled with CUDA graphs (issue 30), on a GPU.

    python bench/cudagraphs.py                 # inductor, modes "default" and "reduce-overhead"
    python bench/cudagraphs.py --quick         # fewer timed rounds

`torch.compile(model, mode="reduce-overhead")` records the compiled forward and backward as
CUDA graphs and replays them: no Python runs inside a replay, and inductor quietly falls back
to plain launches for a graph it cannot record (an input mutated in place, a CPU tensor, a
dynamic shape), which it counts in `counters["inductor"]["cudagraph_skips"]`. hookprof's
model-output check is traced into the forward and writes two counters it owns, so the
question is what of the promise survives. Printed per mode, each against the same run
without hookprof (same seed, same data):

- the first NaN: a data row that overflows layer `inp` in the forward of step 7; the
  event's layer, phase, step, how it was found and the replay's verdict (eager mode names
  `inp`, forward, step 7, reproducible);
- graph breaks, frames compiled after warm-up, and CUDA-graph skips, with and without;
- whether the parameters after the run are bit-identical (NaN-aware) to the run without;
- every step sampled with activation checks: how many layers got an activation abs max;
- step time: none, defaults, every step, interleaved rounds (paired median ratio to none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paths  # noqa: E402,F401  (first: the hookprof under test)
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import hookprof  # noqa: E402
from support.compare import same_bits  # noqa: E402
from support.compiled import OverflowNet, overflow_run  # noqa: E402

BAD_STEP = 7
STEPS = 12
WIDTH = 512
SETTINGS = dict(port=0, summary_at_exit=False, system_metrics=False, stall_detection=False)
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


EVERY = dict(sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)


NET = dict(inputs=64, width=WIDTH, depth=4)


def nan_run(mode: str, attach: bool) -> dict:
    """STEPS steps, step BAD_STEP's batch with a row that overflows `inp`."""
    params, snap, (breaks, compiled, skips) = overflow_run(
        lambda model: torch.compile(model, mode=mode),
        attach=attach,
        device=DEVICE,
        net=NET,
        batch=256,
        steps=STEPS,
        bad_step=BAD_STEP,
        settings=SETTINGS,
    )
    out: dict = {
        "params": params,
        "dynamo": {
            "graph_breaks": breaks,
            "frames_after_warmup": compiled,
            "cudagraph_skips": skips,
        },
    }
    if snap is not None:
        ev = snap.first_nonfinite
        out["event"] = (
            None
            if ev is None
            else {
                "layer": ev.layer,
                "phase": ev.phase,
                "step": ev.step,
                "found_by": ev.found_by,
                "replay": ev.replay,
            }
        )
        out["nonfinite_steps"] = dict(snap.nonfinite_steps)
        out["internal_errors"] = snap.internal_errors
        out["notices"] = list(snap.notices)
    return out


def every_step_statistics(mode: str) -> dict:
    """Every step sampled with activation checks: which layers got statistics and times."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = OverflowNet(**NET).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 64, device=DEVICE)
    with hookprof.attach(model, **SETTINGS, **EVERY) as prof:
        call = torch.compile(model, mode=mode)
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    layers = snap.layers
    return {
        "layers": len(layers),
        "with_abs_max": sum(s.activation_abs_max is not None for s in layers.values()),
        "with_forward_time": sum(s.forward_calls_total > 0 for s in layers.values()),
        "with_grad_norm": sum(s.grad_norm is not None for s in layers.values()),
        "internal_errors": snap.internal_errors,
    }


def timing(mode: str, rounds: int, steps: int) -> dict:
    runs = {}
    torch._dynamo.reset()
    for name, overrides in (("none", None), ("hookprof", {}), ("every step", EVERY)):
        torch.manual_seed(0)
        model = OverflowNet(**NET).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prof = None if overrides is None else hookprof.attach(model, **SETTINGS, **overrides)
        runs[name] = (torch.compile(model, mode=mode), opt, prof)
    x = torch.randn(256, 64, device=DEVICE)

    def go(name: str, n: int) -> float:
        call, opt, _ = runs[name]
        sync()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            opt.step()
        sync()
        return (time.perf_counter() - start) / n

    for name in runs:
        go(name, 5)  # compile, record the graphs, warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            times[name].append(go(name, steps))
    for _, _, prof in runs.values():
        if prof is not None:
            prof.detach()
    base = times["none"]
    return {
        name: {
            "step_ms": statistics.median(t) * 1e3,
            "paired_ratio": statistics.median(a / b for a, b in zip(t, base)),
        }
        for name, t in times.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default="default,reduce-overhead")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of the script (no CUDA graphs)"
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (torch.cuda.is_available() is False)")
    warnings.filterwarnings("ignore")
    rounds, steps = (4, 10) if args.quick else (12, 20)
    print(
        f"# hookprof under torch.compile with CUDA graphs: torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    results = {}
    for mode in args.modes.split(","):
        plain = nan_run(mode, attach=False)
        hooked = nan_run(mode, attach=True)
        r = {
            "without": plain["dynamo"],
            "with": hooked["dynamo"],
            "event": hooked.get("event"),
            "nonfinite_steps": hooked.get("nonfinite_steps"),
            "internal_errors": hooked.get("internal_errors"),
            "bit_identical": same_bits(plain["params"], hooked["params"]),
            "notices": hooked.get("notices"),
        }
        print(f"{mode}: {json.dumps(r, default=str)}", flush=True)
        r["every_step"] = every_step_statistics(mode)
        print(f"{mode} every step: {r['every_step']}", flush=True)
        r["timing"] = timing(mode, rounds, steps)
        print(f"{mode} timing: {r['timing']}", flush=True)
        results[mode] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
