"""Training-step overhead of hookprof, measured side by side in one run.

    python bench/overhead.py                 # full run (~5 min on 2 CPU cores)
    python bench/overhead.py --quick         # a smoke run
    python bench/overhead.py --gpu           # CUDA: issue 13's four workloads, 16 rounds

Each workload trains a held-constant model; every configuration has its own copy of it,
attached once (sampling state carries across rounds as in a real run), and rounds interleave
the configurations in rotating order so that machine noise hits them all alike. The figure
per configuration is the median over rounds of the mean step time in that round; ratios
are to "none" (no hookprof) measured in the same rounds. A second set of ratios is paired by
round: the median over rounds of each round's ratio to the "none" round beside it, which
cancels drifts in the machine's speed that last longer than a round.

With --gpu the workloads are those of issue 13 at full size (bench/shapes.py: the ResNet-50
shape in bf16 and channels_last, the GPT-124M shape and transformers' GPT-2 with fused AdamW,
the 24 x Linear(1024) MLP), each round synchronized before and after, the GPU and the torch
and CUDA versions printed.

Also measured: attach/detach time and per-scrape render time for a model of 10,000 leaf
modules. Prints Markdown tables (pasted into the README) and writes JSON next to them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# this folder, for compare_versions, which runs this file with runpy (no script folder on sys.path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paths  # noqa: E402,F401  (first: the hookprof under test, HOOKPROF_ROOT's or this checkout's)
import shapes  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hookprof  # noqa: E402
from hookprof.serve.exporter import render  # noqa: E402

# ---------------------------------------------------------------- workloads


class ResidualBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + x)


def small_resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        *[ResidualBlock(32) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


def transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False),
        nn.Flatten(),
        nn.Linear(256 * 128, 10),
    )


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[torch.Generator], torch.Tensor]
    batch: int


WORKLOADS = {
    "mlp": Workload("MLP 24x512, batch 64", mlp, lambda g: torch.randn(64, 512, generator=g), 64),
    "transformer": Workload(
        "TransformerEncoder 4x256, batch 8, seq 128",
        transformer,
        lambda g: torch.randn(8, 128, 256, generator=g),
        8,
    ),
    "cnn": Workload(
        "ResNet-style CNN (in-place ReLU), batch 16, 32x32",
        small_resnet,
        lambda g: torch.randn(16, 3, 32, 32, generator=g),
        16,
    ),
}

# ---------------------------------------------------------------- configurations


class OwnClock:
    """perf_counter_ns that stands still while other configurations run. hookprof samples by
    wall time (min_sample_interval_s); interleaving would otherwise let a configuration's
    clock run on during the others' rounds and sample it several times more often than the
    same configuration running alone."""

    def __init__(self):
        self.paused_ns = 0
        self.paused_at: int | None = time.perf_counter_ns()

    def __call__(self) -> int:
        # while paused the clock stands still (hookprof reads it at attach, between rounds)
        now = self.paused_at if self.paused_at is not None else time.perf_counter_ns()
        return now - self.paused_ns

    def pause(self):
        self.paused_at = time.perf_counter_ns()

    def resume(self):
        if self.paused_at is not None:
            self.paused_ns += time.perf_counter_ns() - self.paused_at
            self.paused_at = None


@dataclass
class Runner:
    """One configuration of one workload: its own model copy, optimizer and data."""

    config: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    prof: object | None = None
    round_means: list[float] = field(default_factory=list)
    clock: OwnClock = field(default_factory=OwnClock)

    def __post_init__(self):
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def attach(self, overrides: dict) -> None:
        cfg = hookprof.Config(port=0, **overrides)
        self.prof = hookprof.Profiler(self.model, cfg, clock=self.clock)

    def timed_round(self, n: int) -> None:
        self.clock.resume()
        with self.context():
            self.sync()
            t0 = time.perf_counter()
            self.steps(n)
            self.sync()
            self.round_means.append((time.perf_counter() - t0) / n)
        self.clock.pause()

    def sync(self) -> None:
        pass  # a CPU step has finished when it returns

    def steps(self, n: int) -> None:
        floor = self.config == "floor"
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
            loss.backward()
            if floor:
                read_every_gradient(self.model)
            self.opt.step()

    def context(self):
        if self.config == "torch.profiler":
            return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if self.config == "detect_anomaly":
            return torch.autograd.detect_anomaly(check_nan=True)
        return contextlib.nullcontext()


class ShapeRunner(Runner):
    """One configuration of one of issue 13's workloads (bench/shapes.py) on a GPU."""

    def __init__(self, config: str, shape: shapes.Shape):
        super().__init__(config, shape.model, *shape.batch)
        self.shape = shape
        self.opt = shape.optimizer

    def steps(self, n: int) -> None:
        floor = read_every_gradient if self.config == "floor" else None
        for _ in range(n):
            self.shape.step(before_update=floor)

    def sync(self) -> None:
        if self.shape.batch[0].is_cuda:  # (a CPU step has finished when it returns)
            torch.cuda.synchronize()  # note: between rounds only, never inside the timed steps' loop

    def context(self):
        if self.config == "torch.profiler":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            return torch.profiler.profile(activities=activities)
        return super().context()


def read_every_gradient(model: nn.Module) -> None:
    """The physical floor of exact per-layer NaN localisation on every step: one read of
    every gradient (results left on the device, as hookprof does)."""
    torch._foreach_norm([p.grad for p in model.parameters() if p.grad is not None])


CONFIGS = {
    "none": None,
    "none again": None,  # an A/A pair: how far apart two identical runs land on this machine
    "floor": None,  # no hookprof + one _foreach_norm over all gradients per step
    "hookprof default": {},
    "hookprof loss check": {"nonfinite_check": "loss"},
    "hookprof every step": {"sample_every": 1, "min_sample_interval_s": 0.0},
    # the cost of each efficiency feature (issue 15), on by default: off one at a time
    "default, no FLOPs/updates": {"flop_counting": False, "update_norms": False},
    "every step, no FLOPs": {
        "sample_every": 1,
        "min_sample_interval_s": 0.0,
        "flop_counting": False,
    },
    "every step, no updates": {
        "sample_every": 1,
        "min_sample_interval_s": 0.0,
        "update_norms": False,
    },
    "every step, neither": {
        "sample_every": 1,
        "min_sample_interval_s": 0.0,
        "flop_counting": False,
        "update_norms": False,
    },
    # every sampled step measures its update (the weight and update norm statistics: by
    # default at most once per update_norm_interval_s, 1 s, which most rounds never reach)
    "every step, updates every step": {
        "sample_every": 1,
        "min_sample_interval_s": 0.0,
        "update_norm_interval_s": 0.0,
    },
    # Config.spike_replay armed (issue 43): every step keeps its forward and a copy of its
    # parameters before the update, for a spike's replay (a healthy run replays none)
    "hookprof spike replay": {"spike_replay": True},
    "torch.profiler": None,
    "detect_anomaly": None,
}


def workload_data(key: str) -> tuple[Workload, nn.Module, torch.Tensor, torch.Tensor]:
    """The workload, its seeded model and one fixed batch (inputs, class labels)."""
    w = WORKLOADS[key]
    torch.manual_seed(0)
    base = w.build()
    g = torch.Generator().manual_seed(0)
    x = w.make_input(g)
    return w, base, x, torch.randint(0, 10, (w.batch,), generator=g)


def bench_workload(key: str, rounds: int, steps: int, warmup: int) -> dict:
    w, base, x, y = workload_data(key)
    runners = []
    for name, overrides in CONFIGS.items():
        r = Runner(name, copy.deepcopy(base), x, y)
        if overrides is not None:
            r.attach(overrides)
        runners.append(r)
    return run_rounds(w.name, runners, rounds, steps, warmup)


def bench_shape(
    key: str,
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    *,
    batch_times: int = 1,
    compile_mode: str | None = None,
    backend: str = "inductor",
) -> dict:
    """One of issue 13's workloads (full size on CUDA, narrow on the CPU: a smoke run): each
    configuration builds its own copy (same seed, so the same weights and batch), attached
    first and then compiled whole when `compile_mode` is given ("default", "reduce-overhead":
    what docs/compatibility.md says users may do in either order)."""
    runners = []
    for name, overrides in CONFIGS.items():
        shape = shapes.build(key, device, full=device.type == "cuda", batch_times=batch_times)
        r = ShapeRunner(name, shape)
        if overrides is not None:
            r.attach(overrides)
        if compile_mode is not None:
            mode = None if compile_mode == "default" or backend != "inductor" else compile_mode
            shape.model = torch.compile(shape.model, mode=mode, backend=backend)
        runners.append(r)
    label = runners[0].shape.name
    if compile_mode is None:
        return run_rounds(label, runners, rounds, steps, warmup)
    label += f", compiled ({backend}, mode {compile_mode})"
    from torch._dynamo.utils import counters

    def compiled_so_far() -> tuple[int, int]:
        return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]

    before = compiled_so_far()
    result = run_rounds(label, runners, rounds, steps, warmup, after_warmup=compiled_so_far)
    graphs, skips = (a - b for a, b in zip(compiled_so_far(), before))
    # graphs compiled in all (warm-up included), and during the timed rounds alone (0: no
    # copy recompiled or fell back), CUDA-graph skips (reduce-overhead)
    result["compiled"] = {
        "graphs": graphs,
        "graphs_while_timed": compiled_so_far()[0] - result.pop("_after_warmup")[0],
        "cudagraph_skips": skips,
    }
    print(f"  compiled: {result['compiled']}", flush=True)
    return result


def run_rounds(
    name: str,
    runners: list[Runner],
    rounds: int,
    steps: int,
    warmup: int,
    after_warmup: Callable[[], Any] | None = None,
) -> dict:
    """Warm up each configuration, then interleave timed rounds in rotating order.
    `after_warmup`: read once all are warm, kept as "_after_warmup"."""
    at_warm = None
    try:
        for r in runners:
            r.clock.resume()
            started = time.perf_counter()
            with r.context():
                r.steps(warmup)
                r.sync()
            r.clock.pause()
            # (said as it happens: a compiled copy's warm-up is its compilation, and a run
            # stopped at its limit still shows how far it got)
            print(f"  warmed {r.config}: {time.perf_counter() - started:.1f} s", flush=True)
        if after_warmup is not None:
            at_warm = after_warmup()
        for i in range(rounds):
            order = runners[i % len(runners) :] + runners[: i % len(runners)]
            for r in order:
                r.timed_round(steps)
    finally:
        for r in runners:
            if r.prof is not None:
                r.prof.detach()
    medians = {r.config: statistics.median(r.round_means) for r in runners}
    sampled = {
        r.config: (r.prof.snapshot().sampled_steps, r.prof.snapshot().step)
        for r in runners
        if r.prof is not None
    }
    return {
        "workload": name,
        "step_ms": {k: v * 1e3 for k, v in medians.items()},
        "ratio": {k: v / medians["none"] for k, v in medians.items()},
        # the same ratio taken within each round (each configuration's round against the
        # "none" round next to it in time), median over rounds: drifts in the machine's
        # speed that outlast a round cancel out
        "paired_ratio": {
            r.config: statistics.median(
                a / b for a, b in zip(r.round_means, runners[0].round_means)
            )
            for r in runners
        },
        "sampled_of_steps": sampled,
        "spread": {r.config: (min(r.round_means) * 1e3, max(r.round_means) * 1e3) for r in runners},
        **({} if after_warmup is None else {"_after_warmup": at_warm}),
    }


# ---------------------------------------------------------------- 10,000 leaf modules


def bench_many_layers(n: int = 10_000) -> dict:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)

    def one_step():
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    one_step()  # warm the allocator before timing anything
    t0 = time.perf_counter()
    plain_step = [one_step() for _ in range(1)]
    plain_step_s = time.perf_counter() - t0

    out = {"leaf_modules": n}
    for max_layers in (500, n):
        t0 = time.perf_counter()
        prof = hookprof.attach(
            model, port=0, sample_every=1, min_sample_interval_s=0.0, max_layers=max_layers
        )
        attach_s = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            one_step()  # sampled: hooks on every layer
            sampled_step_s = time.perf_counter() - t0
            prof.flush(timeout=120)
            renders = []
            for _ in range(3):
                t0 = time.perf_counter()
                text = render(prof.registry)
                renders.append(time.perf_counter() - t0)
            samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        finally:
            t0 = time.perf_counter()
            prof.detach()
            detach_s = time.perf_counter() - t0
        out[f"max_layers={max_layers}"] = {
            "attach_ms": attach_s * 1e3,
            "detach_ms": detach_s * 1e3,
            "sampled_step_ms": sampled_step_s * 1e3,
            "plain_step_ms": plain_step_s * 1e3,
            "render_ms": statistics.median(renders) * 1e3,
            "exposition_kb": len(text) / 1024,
            "samples": samples,
        }
    del plain_step
    return out


# ---------------------------------------------------------------- report


def table(results: list[dict]) -> str:
    configs = list(CONFIGS)
    with_floor = "floor" in CONFIGS and "hookprof default" in CONFIGS
    lines = [
        "| workload | " + " | ".join(configs) + (" | default / floor |" if with_floor else " |"),
        "|---|" + "---|" * (len(configs) + with_floor),
    ]
    for r in results:
        cells = []
        for c in configs:
            ms, ratio = r["step_ms"][c], r["ratio"][c]
            cells.append(f"{ms:.1f} ms" if c == "none" else f"{ms:.1f} ms ({ratio:.3f}x)")
        last = ""
        if with_floor:
            last = f" {r['step_ms']['hookprof default'] / r['step_ms']['floor']:.3f}x |"
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |" + last)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 steps")
    parser.add_argument("--skip-many-layers", action="store_true")
    parser.add_argument(
        "--configs",
        default=None,
        help="a comma-separated subset of the configurations (default: all); "
        "'none' is always measured",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="issue 13's workloads on CUDA (default 16 rounds; --workloads from "
        f"{','.join(shapes.NAMES)})",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        help="with --gpu: cpu runs the same workloads narrow (a smoke run of the GPU path)",
    )
    parser.add_argument(
        "--batch-times",
        type=int,
        default=1,
        help="with --gpu: the batch this many times larger (a device-bound variant)",
    )
    parser.add_argument(
        "--compile",
        default=None,
        choices=("default", "reduce-overhead"),
        help="with --gpu: each copy compiled whole with torch.compile in this mode",
    )
    parser.add_argument("--compile-backend", default="inductor", help="with --compile")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "overhead.json")
    )
    args = parser.parse_args(argv)
    if args.configs:
        keep, unknown = ["none"], []
        # some names hold a comma themselves ("every step, neither"): the longest known name
        # at each point is taken, so "a,every step, neither" is two names
        rest = args.configs.strip()
        while rest:
            name = max(
                (c for c in CONFIGS if rest == c or rest.startswith(c + ",")), key=len, default=None
            )
            if name is None:
                name, _, _ = rest.partition(",")
                unknown.append(name.strip())
            keep.append(name)
            rest = rest[len(name) :].lstrip(",").strip()
        if unknown:
            parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
        for c in list(CONFIGS):
            if c not in keep:
                del CONFIGS[c]
    if args.gpu:
        return main_gpu(args, argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 5, 2
    warnings.filterwarnings("ignore")  # detect_anomaly warns on every step

    print(
        f"# hookprof {hookprof.__version__}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; "
        f"{args.rounds} rounds x {args.steps} steps",
        flush=True,
    )
    results = []
    for key in args.workloads.split(","):
        r = bench_workload(key, args.rounds, args.steps, args.warmup)
        results.append(r)
        print(f"{key}: " + ", ".join(f"{c} {v:.3f}x" for c, v in r["ratio"].items()), flush=True)
        print(
            f"{key} (paired by round): "
            + ", ".join(f"{c} {v:.3f}x" for c, v in r["paired_ratio"].items()),
            flush=True,
        )
    print()
    print(table(results))
    many = None
    if not args.skip_many_layers:
        many = bench_many_layers()
        print()
        print(
            "| 10,000 leaf modules | attach | detach | plain step | sampled step "
            "| render /metrics | exposition |"
        )
        print("|---|---|---|---|---|---|---|")
        for key in ("max_layers=500", "max_layers=10000"):
            m = many[key]
            print(
                f"| {key} | {m['attach_ms']:.0f} ms | {m['detach_ms']:.0f} ms "
                f"| {m['plain_step_ms']:.0f} ms | {m['sampled_step_ms']:.0f} ms "
                f"| {m['render_ms']:.1f} ms | {m['exposition_kb']:.0f} KiB, {m['samples']} samples |"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workloads": results, "many_layers": many, "args": vars(args)}, f, indent=2)
    return 0


def main_gpu(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Issue 13's table: the four workloads on CUDA, 16+ interleaved rounds (with --device
    cpu, narrow: a smoke run of this path, bench/gpu_session.sh's DRY mode)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA (torch.cuda.is_available() is False)")
    given = sys.argv[1:] if argv is None else argv
    if "--rounds" not in given:
        args.rounds = 16
    if "--workloads" not in given:
        args.workloads = ",".join(
            n for n in shapes.NAMES if n != "hf-gpt2" or shapes.hf_available()
        )
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 3, 2
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (narrow shapes)"
    print(
        f"# hookprof {hookprof.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{name}; {args.rounds} rounds x {args.steps} steps; batch x{args.batch_times}; "
        f"compiled: {args.compile or 'no'}; {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    results = []
    for key in args.workloads.split(","):
        r = bench_shape(
            key,
            args.rounds,
            args.steps,
            args.warmup,
            device,
            batch_times=args.batch_times,
            compile_mode=args.compile,
            backend=args.compile_backend,
        )
        results.append(r)
        print(f"{key}: " + ", ".join(f"{c} {v:.3f}x" for c, v in r["ratio"].items()), flush=True)
        print(
            f"{key} (paired by round): "
            + ", ".join(f"{c} {v:.3f}x" for c, v in r["paired_ratio"].items()),
            flush=True,
        )
        print(
            f"{key} (ms): " + ", ".join(f"{c} {v:.2f}" for c, v in r["step_ms"].items()), flush=True
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # (written after each workload: a run stopped at its limit keeps those done)
        out = args.out.replace("overhead.json", "overhead-gpu.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(
                {
                    "workloads": results,
                    "gpu": name,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "args": vars(args),
                },
                f,
                indent=2,
            )
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
