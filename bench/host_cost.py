"""hookprof's host work per training step, for the four workload shapes of issue 13.

    python bench/host_cost.py                  # CPU: narrow models (bench/shapes.py), ~2 min
    python bench/host_cost.py --against main   # the same, for main and this checkout side by side
    python bench/host_cost.py --full           # the issue's sizes (on a GPU)
    python bench/host_cost.py --floor-only     # only the fused-check floor below (~1 min)

Printed per workload:
Times are host wall time on CUDA, and on a CPU the timed thread's CPU time with torch on one
thread (a shared machine's other processes do not count).

- unsampled: host microseconds hookprof spends per unsampled step, timed around its own
  calls (root forward pre-hook and output hook, optimizer pre/post hooks, prof.step), and
  the ATen ops it issues in them (each a kernel launch on a GPU), the tensors those ops
  return (a foreach op with N outputs counts N) and the Python calls into hookprof's files
  over the whole step (issue 37: none of the three may grow with the model). On CUDA nothing in there
  waits for the device, so the time is host time, the issue's target (<= 100 us on the
  ResNet-50 shape); on a CPU every op runs where it is issued, so the time includes reading
  every gradient: a trend, not the target.
- sampled: host microseconds per instrumented leaf on a sampled step: (host time of a sampled
  step - host time of an unsampled one, medians, same profiler, alternating steps) / layers.
  On CUDA each step starts after a synchronize and is timed until the optimizer returns,
  without waiting for the device. Target on CUDA: <= 10 us.
- floor: side by side in one run, on a model of 256 tiny gradients (128 x Linear(4, 4)), the
  CPU time an unsampled step costs over a bare loop, for hookprof (the accelerator's gradient
  path; its flags on the host, and on an emulated device 3 steps behind as a GPU's are) and
  for the cheapest every-step check there is, a fused flag alone (one
  `torch._amp_foreach_non_finite_check_and_unscale_` over the gradients plus the loss's
  flag, which names no layer): the ratio of the two extras (issue 37's target: at most 3x).
- publisher: resolving one sampled step's timings for a model of 500 layers: the longest
  stretch the publisher thread holds the GIL while resolving (it releases it every
  RESOLVE_CHUNK events), the whole resolution, and the whole fold of the step, all in the
  thread's CPU time (what it computes while holding the GIL; wall time would add the OS's
  preemptions on a loaded machine). On a CPU the
  timer is the CUDA event timer over tests/support/fake_gpu.py's stand-in events (the publisher's
  Python is what is measured); on CUDA, real events. Target: <= 1 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import paths  # first: the hookprof under test (HOOKPROF_ROOT, set by --against) or this checkout's
import shapes
import torch
from torch import nn

import hookprof
from hookprof._testing import step_boundary_methods, step_is_sampled, timing_resolution_method
from support.op_counter import CallCounter, OpCounter


class BoundaryMeter:
    """Times (and optionally counts the ATen ops of) the profiler's step-boundary methods
    (hookprof._testing.step_boundary_methods). Patched on their class before attach(), which
    binds them as hooks; nested calls count once."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.ns = 0
        self.counter: OpCounter | None = None
        self._depth = threading.local()
        self._saved: dict[str, object] = {}
        self._owner: type | None = None

    def install(self) -> None:
        owner, names = step_boundary_methods()
        for name in names:
            original = getattr(owner, name)
            self._saved[name] = original
            setattr(owner, name, self._wrap(original))
        self._owner = owner

    def remove(self) -> None:
        for name, original in self._saved.items():
            setattr(self._owner, name, original)

    def _wrap(self, original):
        meter = self

        def timed(*args, **kwargs):
            depth = getattr(meter._depth, "n", 0)
            if depth:
                return original(*args, **kwargs)
            meter._depth.n = 1
            mode = meter.counter if meter.counter is not None else contextlib.nullcontext()
            t0 = meter.clock()
            try:
                with mode:
                    return original(*args, **kwargs)
            finally:
                meter.ns += meter.clock() - t0
                meter._depth.n = 0

        return timed


def host_clock(device: torch.device):
    """Host time on CUDA (wall: launches that wait for a full queue count, as in a loop). On a
    CPU the thread's CPU time, with torch on this one thread (see main): the machine may be
    shared, and time the OS gives to other processes is not hookprof's."""
    return time.perf_counter_ns if device.type == "cuda" else time.thread_time_ns


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # note: outside the timed part, so each step starts idle


def measure_workload(
    name: str, device: torch.device, full: bool, steps: int, accelerator_path: bool
) -> dict:
    shape = shapes.build(name, device, full=full)
    clock = host_clock(device)
    meter = BoundaryMeter(clock)
    meter.install()
    try:
        gradients = sys.modules.get("hookprof.step.gradients")
        forced = (
            accelerator_path
            and hasattr(gradients, "GradientNorms")
            and hasattr(gradients.GradientNorms, "cpu_dot_per_tensor")
        )
        if forced:
            gradients.GradientNorms.cpu_dot_per_tensor = False
        prof = hookprof.attach(
            shape.model, port=0, sample_every=2, min_sample_interval_s=0.0, summary_at_exit=False
        )
        try:
            for _ in range(4):  # warm-up: the first sampled step, cached plans, allocators
                shape.step()
            host = {True: [], False: []}
            boundary = []
            for _ in range(steps):
                sampled = step_is_sampled(prof)
                sync(device)
                meter.ns = 0
                t0 = clock()
                shape.step()
                host[sampled].append(clock() - t0)
                if not sampled:
                    boundary.append(meter.ns)
                sync(device)
            layers = len(prof.table)
        finally:
            prof.detach()
        # the counts of an unsampled step whose neighbours are unsampled too (with sampling
        # every other step, its end would put the next sampled step's layer hooks in)
        prof = hookprof.attach(
            shape.model,
            port=0,
            sample_every=1000,
            min_sample_interval_s=3600.0,
            summary_at_exit=False,
        )
        try:
            for _ in range(3):  # step 1 is sampled; step 2 makes the cached plans
                shape.step()
            meter.counter = OpCounter()
            with CallCounter() as calls:
                shape.step()
            ops, tensors = meter.counter.ops, meter.counter.outputs
            meter.counter = None
        finally:
            prof.detach()
            if forced:
                gradients.GradientNorms.cpu_dot_per_tensor = True
    finally:
        meter.remove()
    unsampled_us = statistics.median(boundary) / 1e3
    per_leaf_us = (statistics.median(host[True]) - statistics.median(host[False])) / 1e3 / layers
    return {
        "workload": shape.name,
        "grads": sum(1 for p in shape.model.parameters() if p.requires_grad),
        "layers": layers,
        "unsampled_us": unsampled_us,
        "unsampled_ops": sum(ops.values()),
        "unsampled_tensors": tensors,
        "unsampled_python_calls": sum(calls.calls.values()),
        "foreach_norm_ops": ops.get("aten._foreach_norm.Scalar", 0),
        "sampled_per_leaf_us": per_leaf_us,
        "step_ms_unsampled": statistics.median(host[False]) / 1e6,
        "accelerator_path": forced,
    }


def measure_floor(rounds: int = 7, steps: int = 40, layers: int = 128) -> dict:
    """hookprof's unsampled step against the fused-check floor (see the module docstring):
    three copies of one model of `layers` x Linear(4, 4) trained side by side, `rounds`
    interleaved rounds of `steps` steps each; the thread's CPU time per step, medians."""
    import copy as _copy
    from contextlib import nullcontext

    from support.lagging_device import lagging_device

    gradients = sys.modules.get("hookprof.step.gradients")
    torch.manual_seed(0)
    base = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
    x = torch.randn(8, 4)
    clock = time.thread_time_ns

    def make():
        model = _copy.deepcopy(base)
        return model, torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step the same

    def step(model, opt, prof=None, fused=None):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        if fused is not None:  # the floor: one fused flag over every gradient, and the loss's
            found, inv = fused
            grads = [p.grad for p in model.parameters()]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            found.logical_or_(loss.detach().isinf().logical_or_(loss.detach().isnan()))
        opt.step()
        if prof is not None:
            prof.step(loss)

    result = {"gradients": 2 * layers, "rounds": rounds, "steps": steps}
    for label, device in (
        ("host flags", nullcontext),
        ("device flags (emulated, lag 3)", lambda: lagging_device(3)),
    ):
        saved = getattr(gradients.GradientNorms, "cpu_dot_per_tensor", None)
        if saved is not None:
            gradients.GradientNorms.cpu_dot_per_tensor = False  # the accelerator's reduction
        times = {"bare": [], "fused": [], "hookprof": []}
        try:
            with device():
                bare, fused, watched = make(), make(), make()
                flags = (torch.zeros(1), torch.ones(1))
                prof = hookprof.attach(
                    watched[0],
                    port=0,
                    sample_every=1000,
                    min_sample_interval_s=3600.0,
                    summary_at_exit=False,
                )
                try:
                    for _ in range(5):  # warm-up: plans, allocators; step 1 is the sampled one
                        step(*bare), step(*fused, fused=flags), step(*watched, prof=prof)
                    for _ in range(rounds):
                        for name, run in (
                            ("bare", lambda: step(*bare)),
                            ("fused", lambda: step(*fused, fused=flags)),
                            ("hookprof", lambda: step(*watched, prof=prof)),
                        ):
                            for _ in range(steps):
                                t0 = clock()
                                run()
                                times[name].append(clock() - t0)
                finally:
                    prof.detach()
        finally:
            if saved is not None:
                gradients.GradientNorms.cpu_dot_per_tensor = saved
        med = {k: statistics.median(v) / 1e3 for k, v in times.items()}
        extra_fused, extra_hookprof = med["fused"] - med["bare"], med["hookprof"] - med["bare"]
        result[label] = {
            "bare_us": med["bare"],
            "fused_extra_us": extra_fused,
            "hookprof_extra_us": extra_hookprof,
            "ratio": extra_hookprof / extra_fused if extra_fused > 0 else float("nan"),
        }
    return result


def measure_publisher(device: torch.device, layers: int = 500, steps: int = 8) -> dict:
    """Resolving one sampled step of a `layers`-layer model: GIL stretches and totals."""
    from hookprof.device import timing

    pairs = [m for _ in range(layers // 2) for m in (nn.Linear(16, 16), nn.ReLU())]
    model = nn.Sequential(*pairs).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=device)
    stamps: list[int] = []  # perf_counter_ns at each GIL release inside a resolution

    # thread CPU time, not wall time: on a loaded machine the OS preempts the thread while it
    # holds the GIL, and that is not work of ours
    clock = time.thread_time_ns

    def yield_gil() -> None:
        stamps.append(clock())
        time.sleep(0)

    if device.type == "cuda":
        try:
            timer = timing.CudaEventTimer(yield_gil=yield_gil)
        except TypeError:  # a version without the chunked resolution
            timer = timing.CudaEventTimer()
        kind = "real CUDA events"
    else:
        from support import fake_gpu

        stream = fake_gpu.FakeStream()
        try:
            timer = timing.CudaEventTimer(
                event_factory=fake_gpu.FakeEvent, current_stream=lambda: stream, yield_gil=yield_gil
            )
        except TypeError:
            timer = timing.CudaEventTimer(event_factory=fake_gpu.FakeEvent)
        kind = "stand-in CUDA events (tests/support/fake_gpu.py)"
    longest, resolve_ns, fold_ns, tokens = [], [], [], []
    folder, resolve = timing_resolution_method()
    original_resolve = getattr(folder, resolve)
    original_fold = folder.fold

    def timed_resolve(self, rec, tmr):
        tokens.append(sum(1 for _ in rec.tokens()))
        stamps.clear()
        t0 = clock()
        try:
            return original_resolve(self, rec, tmr)
        finally:
            t1 = clock()
            marks = [t0, *stamps, t1]
            longest.append(max(b - a for a, b in zip(marks, marks[1:])))
            resolve_ns.append(t1 - t0)

    def timed_fold(self, packet, tmr):
        t0 = clock()
        try:
            return original_fold(self, packet, tmr)
        finally:
            if packet.record is not None:  # not the drains of the counters that flush() sends
                fold_ns.append(clock() - t0)

    setattr(folder, resolve, timed_resolve)
    folder.fold = timed_fold
    try:
        cfg = hookprof.Config(port=0, sample_every=1, min_sample_interval_s=0.0)
        prof = hookprof.Profiler(model, cfg, timer=timer)
        try:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
                prof.flush()
        finally:
            prof.detach()
    finally:
        setattr(folder, resolve, original_resolve)
        folder.fold = original_fold
    skip = 2  # the first folds build the per-layer tables
    return {
        "layers": layers,
        "timer": kind,
        "events_per_step": tokens[-1],
        "longest_gil_hold_ms": statistics.median(longest[skip:]) / 1e6,
        "resolve_ms": statistics.median(resolve_ns[skip:]) / 1e6,
        "fold_ms": statistics.median(fold_ns[skip:]) / 1e6,
    }


def profile_workload(
    name: str, device: torch.device, full: bool, steps: int, top: int = 18
) -> None:
    """Where hookprof's host time goes: cProfile over `steps` unsampled steps, then `steps`
    sampled ones, of one workload; prints hookprof's functions by their own time per step
    (cProfile slows every Python call alike, so read the shares, not the microseconds)."""
    import cProfile
    import pstats

    shape = shapes.build(name, device, full=full)
    for label, every in (("unsampled", 1_000_000), ("sampled", 1)):
        prof = hookprof.attach(shape.model, port=0, sample_every=every, min_sample_interval_s=0.0)
        try:
            for _ in range(4):
                shape.step()
            sync(device)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(steps):
                shape.step()
            profiler.disable()
            sync(device)
        finally:
            prof.detach()
        stats = pstats.Stats(profiler)
        rows = []
        for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
            if f"{os.sep}hookprof{os.sep}" in path and f"{os.sep}bench{os.sep}" not in path:
                rows.append(
                    (
                        own,
                        cumulative,
                        calls,
                        f"{os.path.relpath(path, os.path.dirname(paths.UNDER_TEST))}:{line} {func}",
                    )
                )
        total = sum(r[0] for r in rows)
        print(
            f"# profile, {shape.name}, {label} steps: hookprof's own time {total / steps * 1e6:.0f} us/step "
            f"under cProfile; top {top} by own time (us/step own, us/step cumulative, calls/step)"
        )
        for own, cumulative, calls, where in sorted(rows, reverse=True)[:top]:
            print(
                f"#   {own / steps * 1e6:8.1f} {cumulative / steps * 1e6:9.1f} {calls / steps:7.1f}  {where}"
            )


def run_here(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # every op on the timed thread (see host_clock)
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=os.path.dirname(hookprof.__file__),
        capture_output=True,
        text=True,
    ).stdout.strip()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    result = {
        "hookprof": paths.hookprof_checkout(),
        "rev": rev,
        "torch": torch.__version__,
        "device": gpu or f"CPU ({os.cpu_count()} cores)",
        "full": args.full,
        "workloads": [],
        "publisher": None,
    }
    if args.floor_only:
        args.workloads, args.skip_publisher = "", True
    for name in filter(None, args.workloads.split(",")):
        if name == "hf-gpt2" and not shapes.hf_available():
            print(f"# {name}: transformers is not importable, skipped", flush=True)
            continue
        r = measure_workload(name, device, args.full, args.steps, args.accelerator_path)
        result["workloads"].append(r)
        print(f"# {name}: {json.dumps(r)}", flush=True)
    for name in args.profile.split(",") if args.profile else ():
        profile_workload(name, device, args.full, steps=10)
    if device.type == "cpu" and not args.skip_floor:
        result["floor"] = measure_floor()
        print(f"# floor: {json.dumps(result['floor'])}", flush=True)
    if not args.skip_publisher:
        result["publisher"] = measure_publisher(device)
        print(f"# publisher: {json.dumps(result['publisher'])}", flush=True)
    return result


def table(results: list[tuple[str, dict]]) -> str:
    labels = [label for label, _ in results]
    head = (
        "| workload (grads, layers) | "
        + " | ".join(
            f"unsampled us/step ({lb}) | ATen ops / tensors / Python calls per unsampled step ({lb}) | "
            f"sampled us/leaf ({lb})"
            for lb in labels
        )
        + " |"
    )
    lines = [head, "|---|" + "---|---|---|" * len(labels)]
    first = results[0][1]["workloads"]
    for w in first:
        cells = []
        for _, r in results:
            x = next((v for v in r["workloads"] if v["workload"] == w["workload"]), None)
            if x is None:
                cells += ["-", "-", "-"]
                continue
            counts = " / ".join(
                str(x[k]) if k in x else "-"
                for k in ("unsampled_ops", "unsampled_tensors", "unsampled_python_calls")
            )
            cells += [f"{x['unsampled_us']:.0f}", counts, f"{x['sampled_per_leaf_us']:.1f}"]
        lines.append(
            f"| {w['workload']} ({w['grads']}, {w['layers']}) | " + " | ".join(cells) + " |"
        )
    floors = [(lb, r["floor"]) for lb, r in results if r.get("floor")]
    if floors:
        lines += [
            "",
            f"| {floors[0][1]['gradients']} tiny gradients, CPU us per unsampled step | "
            + " | ".join(lb for lb, _ in floors)
            + " |",
            "|---|" + "---|" * len(floors),
        ]
        for flags in ("host flags", "device flags (emulated, lag 3)"):
            lines.append(
                f"| {flags}: hookprof's extra / a fused flag's extra (ratio) | "
                + " | ".join(
                    f"{f[flags]['hookprof_extra_us']:.0f} / {f[flags]['fused_extra_us']:.0f} "
                    f"({f[flags]['ratio']:.2f}x)"
                    for _, f in floors
                )
                + " |"
            )
    pubs = [(lb, r["publisher"]) for lb, r in results if r.get("publisher")]
    if pubs:
        lines += [
            "",
            "| publisher, one sampled step of 500 layers | "
            + " | ".join(lb for lb, _ in pubs)
            + " |",
            "|---|" + "---|" * len(pubs),
        ]
        for key, what in (
            ("longest_gil_hold_ms", "longest GIL hold while resolving (ms)"),
            ("resolve_ms", "whole resolution (ms)"),
            ("fold_ms", "whole fold (ms)"),
        ):
            lines.append(f"| {what} | " + " | ".join(f"{p[key]:.2f}" for _, p in pubs) + " |")
    return "\n".join(lines)


def against(rev: str, argv: list[str]) -> list[tuple[str, dict]]:
    """This script once per version, each in its own process with that version's hookprof
    (compare_versions.alternate, one round)."""
    from compare_versions import alternate, without

    runs = alternate(__file__, rev, 1, without(argv, "--against", "--json"))
    return [(label, results[0]) for label, results in runs.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--full", action="store_true", help="the issue's sizes (for a GPU)")
    parser.add_argument(
        "--steps", type=int, default=20, help="measured steps per workload (half sampled)"
    )
    parser.add_argument("--workloads", default=",".join(shapes.NAMES))
    parser.add_argument(
        "--accelerator-path",
        action="store_true",
        help="on a CPU, reduce gradients as on a GPU (one fused pass), where the version can",
    )
    parser.add_argument("--skip-publisher", action="store_true")
    parser.add_argument(
        "--skip-floor", action="store_true", help="leave out the fused-check floor (CPU only)"
    )
    parser.add_argument("--floor-only", action="store_true", help="only the fused-check floor")
    parser.add_argument(
        "--profile",
        metavar="WORKLOADS",
        default="",
        help="also profile hookprof's functions on these workloads (cProfile)",
    )
    parser.add_argument(
        "--against", metavar="REV", help="also run a git revision (in a temporary worktree)"
    )
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    print(
        f"# hookprof host cost: torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"device {args.device}{' (' + torch.cuda.get_device_name() + ')' if args.device == 'cuda' else ''}, "
        f"{'full' if args.full else 'narrow'} sizes",
        flush=True,
    )
    if args.against:
        results = against(args.against, argv)
    else:
        results = [("this checkout", run_here(args))]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results[0][1], f, indent=2)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
