"""Per-feature micro-benchmarks: what one part of hookprof costs, each part timed (or counted)
alone, with one printer and one way to put two versions side by side.

    python bench/parts.py PART [options]                        # this checkout
    python bench/parts.py PART --against main [--processes N]   # main and this checkout
    python bench/parts.py PART --help                           # what it measures, its options

Parts, and the command each replaces (same workloads, same figures):

    leaf           python bench/leaf_cost.py
    leaf-marks     python bench/leaf_marks.py
    sampled-work   python bench/sampled_work.py
    progress       python bench/progress_cost.py
    efficiency     python bench/efficiency_cost.py
    closure-guard  python bench/closure_guard_cost.py
    guard-device   python bench/guard_device_cost.py

Options map one to one (`closure_guard_cost.py --rounds 5 --steps 100` is `parts.py
closure-guard --rounds 5 --steps 100`), except the number of processes per version under
--against: `leaf_cost.py --against main --rounds 4` is `parts.py leaf --against main
--processes 4`, and so for sampled_work.py.

--against REV runs the part once per version and process (REV in a temporary git worktree,
bench/compare_versions.alternate), alternating which goes first, and prints each figure's
median over processes per version and their ratio, this checkout over REV. REV's hookprof
must have the accessors of hookprof/_testing.py the part uses.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import paths  # first: the hookprof under test (HOOKPROF_ROOT, set by --against) or this checkout's
import torch
from torch import nn

# ---------------------------------------------------------------- what a part returns


@dataclass
class Table:
    """A part's figures: rows of cells under columns, each column with its format."""

    title: str
    columns: list[tuple[str, str]]  # (header with its unit, format spec of its cells)
    rows: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, label: str, *cells: float | None) -> None:
        self.rows[label] = list(cells)


def best_us(fn: Callable[[], object], inner: int, reps: int) -> float:
    """Best over `reps` of the mean of `inner` calls of fn, in microseconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best / inner / 1e3


# ---------------------------------------------------------------- leaf


LEAF_DEPTH = 60  # blocks per model


def leaf_models() -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]]:
    def mlp():
        return nn.Sequential(
            *[m for _ in range(LEAF_DEPTH) for m in (nn.Linear(8, 8), nn.ReLU())]
        ), torch.randn(2, 8)

    def convnet():
        blocks = [
            m
            for _ in range(LEAF_DEPTH)
            for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        ]
        return nn.Sequential(*blocks), torch.randn(1, 4, 4, 4)

    return {"mlp": mlp, "convnet": convnet}


def leaf_per_model(
    name: str, steps: int, flop_counting: bool, activation_stats: bool = False
) -> tuple[int, float, float]:
    """(leaves, forward us per leaf, backward us per leaf) of one model, in this process."""
    import hookprof

    torch.set_num_threads(1)
    build = leaf_models()[name]
    torch.manual_seed(0)
    bare, x = build()
    torch.manual_seed(0)
    hooked, _ = build()
    # sampled every step; the periodic extras (activation statistics, update norms) off, so
    # that every step is the same and the figure is the hooks' (activation statistics on
    # every step in their own variant: the output checks and the per-layer statistics)
    prof = hookprof.attach(
        hooked,
        port=0,
        sample_every=1,
        min_sample_interval_s=0.0,
        activation_interval_s=0.0 if activation_stats else 86400.0,  # (its bound: a day)
        update_norms=False,
        system_metrics=False,
        summary_at_exit=False,
        flop_counting=flop_counting,
    )
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

    return (
        leaves,
        (p20(times[hooked][0]) - p20(times[bare][0])) / leaves,
        (p20(times[hooked][1]) - p20(times[bare][1])) / leaves,
    )


def leaf_calls(calls: int = 400, reps: int = 30) -> tuple[float, float, float, float]:
    """The hooks' own Python per layer call, without a model around it: LayerHooks' start and
    end of a call (what the forward wrapper calls) on a chain of tensors with distinct
    autograd nodes, then the registration of their backward marks (mark_pending); and
    FlopCounter.note for forward(x); and start + end again with activation statistics on
    (the output check and hookprof's built-in statistics), calls alternating between the
    Linear and the ReLU (which alone takes the zero ratio). Best of `reps`, in microseconds
    per call."""
    from hookprof._testing import layer_call
    from hookprof.device.timing import CpuTimer
    from hookprof.efficiency.flops import FlopCounter
    from hookprof.faults import Faults
    from hookprof.layers import LayerTable
    from hookprof.step.hooks import LayerHooks
    from hookprof.step.record import StepRecord

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    table = LayerTable(model)
    hooks = LayerHooks(table, CpuTimer(), Faults(), activation_stats=False)
    start, end = layer_call(hooks)
    clock = time.perf_counter_ns
    best_calls = best_register = best_note = best_stats = float("inf")
    try:  # (a version whose built-in statistics are parts given to the hooks)
        from hookprof.step.builtin_statistics import BUILT_IN as own_statistics
    except ImportError:
        own_statistics = ()
    with_stats = LayerHooks(
        table, CpuTimer(), Faults(), activation_stats=True, statistics=own_statistics
    )
    start_stats, end_stats = layer_call(with_stats)
    for _ in range(reps):
        chain = [torch.randn(2, 4, requires_grad=True) * 1.0]
        for _ in range(calls):
            chain.append(chain[-1] * 1.0)
        with_stats.begin(StepRecord(0), install=False)
        with_stats.root_forward_began(True)
        t0 = clock()
        for k in range(calls):
            if start_stats(k % 2, (chain[k],), None):
                end_stats(k % 2, chain[k + 1])
        best_stats = min(best_stats, clock() - t0)
        with_stats.root_output_arrived()
        with_stats.end()
    for _ in range(reps):
        chain = [torch.randn(2, 4, requires_grad=True) * 1.0]
        for _ in range(calls):
            chain.append(chain[-1] * 1.0)  # each with its own autograd node
        hooks.begin(StepRecord(0), install=False)
        hooks.root_forward_began(True)
        t0 = clock()
        for k in range(calls):
            if start(0, (chain[k],), None):
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
    return (
        best_calls / calls / 1e3,
        best_register / calls / 1e3,
        best_note / calls / 1e3,
        best_stats / calls / 1e3,
    )


def leaf(args: argparse.Namespace) -> list[Table]:
    """Host time per instrumented leaf of a sampled step's per-layer hooks, forward and
    backward apart, for a deep narrow MLP (Linear + ReLU) and a small conv net (Conv2d +
    BatchNorm2d + ReLU), FLOP counting off and on; and the hooks' own calls timed alone.

    In one process the same model runs bare and with hookprof attached (sampled every step),
    step after step in turn, so that the machine's load falls on both alike; per leaf is
    (20th percentile with hookprof - 20th percentile bare) / leaves, in the thread's CPU time,
    forward (the hooks of every call, the root module's hooks, the registration of the
    backward marks) and backward (the node pre-hooks) apart. On a CPU the timer is the host
    clock (~0.06 us a mark); on CUDA each mark is an event record (~3 us on an H100, not
    counted here: the leaf-marks part counts them)."""
    per_leaf = Table(
        "per instrumented leaf of a sampled step, host CPU time (us)",
        [("forward us/leaf", ".2f"), ("backward us/leaf", ".2f"), ("total", ".2f")],
    )
    for name in leaf_models():
        for flops, stats in ((False, False), (True, False), (False, True)):
            leaves, fwd, bwd = leaf_per_model(name, args.steps, flops, stats)
            per_leaf.add(
                f"{name} ({leaves} leaves), FLOP counting {'on' if flops else 'off'}"
                + (", activation statistics on" if stats else ""),
                fwd,
                bwd,
                fwd + bwd,
            )
    per_call = Table("per layer call, no model around it (best of 30)", [("us", ".2f")])
    for what, us in zip(
        (
            "start + end of a call",
            "registering its backward mark",
            "FlopCounter.note, forward(x)",
            "start + end of a call, activation statistics on",
        ),
        leaf_calls(),
    ):
        per_call.add(what, us)
    return [per_leaf, per_call]


def leaf_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=150, help="measured steps per model and variant"
    )


# ---------------------------------------------------------------- leaf-marks


def leaf_marks_python_calls(name: str) -> tuple[float, float]:
    """(all Python function calls, hookprof's own) per leaf: a sampled step's count minus an
    unsampled one's, divided by the leaves."""
    import cProfile
    import io
    import pstats

    import shapes

    import hookprof
    from hookprof._testing import step_is_sampled

    shape = shapes.build(name, torch.device("cpu"), full=False)
    prof = hookprof.attach(
        shape.model, port=0, sample_every=2, min_sample_interval_s=0.0, summary_at_exit=False
    )
    counts: dict[bool, tuple[int, int]] = {}
    try:
        for _ in range(6):  # warm-up: hooks installed, FLOPs of each signature counted
            shape.step()
        while len(counts) < 2:
            sampled = step_is_sampled(prof)
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
    return (
        (counts[True][0] - counts[False][0]) / leaves,
        (counts[True][1] - counts[False][1]) / leaves,
    )


def leaf_marks(args: argparse.Namespace) -> list[Table]:
    """Timer marks (CUDA event records on a GPU), hook calls and Python function calls per
    instrumented leaf on one sampled step, for the four workload shapes of issue 13
    (bench/shapes.py, narrow sizes: the counts do not depend on width). Deterministic: marks
    are counted with tests/support/fake_gpu.py's stand-in events, Python calls with cProfile's count
    (one sampled step - one unsampled step, the same profiler), so it runs on a CPU, needs no
    repetition and is not moved by a loaded machine."""
    import shapes

    from support.mark_counter import count_sampled_step

    table = Table(
        "one sampled step, counted",
        [
            ("leaves", "d"),
            ("forward calls", "d"),
            ("layer marks", "d"),
            ("marks/leaf", ".2f"),
            ("forward", "d"),
            ("outer", "d"),
            ("node pre-hooks", "d"),
            ("param hooks", "d"),
            ("step phase marks", "d"),
            ("hook calls/leaf", ".2f"),
            ("Python calls/leaf", ".1f"),
            ("hookprof's Python calls/leaf", ".1f"),
        ],
    )
    for name in args.workloads.split(","):
        if name == "hf-gpt2" and not shapes.hf_available():
            continue
        shape = shapes.build(name, torch.device("cpu"), full=False)
        c = count_sampled_step(shape.model, shape.step)
        py_all, py_own = leaf_marks_python_calls(name)
        table.add(
            shape.name,
            c.layers,
            c.forward_calls,
            c.layer_marks,
            c.marks_per_leaf,
            c.forward_marks,
            c.outer_marks,
            c.node_marks,
            c.param_marks,
            c.step_marks,
            c.hook_calls / c.layers,
            py_all,
            py_own,
        )
    return [table]


def leaf_marks_options(parser: argparse.ArgumentParser) -> None:
    import shapes

    parser.add_argument(
        "--workloads", default=",".join(shapes.NAMES), help="of bench/shapes.py (default: all)"
    )


# ---------------------------------------------------------------- sampled-work


def sampled_work_efficiency(peak_flops: float | None):
    from hookprof.efficiency.figures import StepEfficiency
    from hookprof.layers import LayerTable
    from hookprof.notices import Notices

    return StepEfficiency(
        LayerTable(nn.Sequential(nn.Linear(4, 4), nn.ReLU())),
        flops=True,
        update_norms=False,
        update_max_bytes=0,
        peak_flops=peak_flops,
        notices=Notices(),
    )


def layer_call_us() -> float:
    """What LayerHooks calls for a `forward(x)` layer call of a sampled step with FLOP
    counting on: what StepEfficiency.listen sets LayerHooks.on_call to."""
    eff = sampled_work_efficiency(1e12)
    hooks = types.SimpleNamespace(on_call=None)
    eff.listen(hooks)  # on_call changes after a step's first call
    x = torch.randn(2, 4, requires_grad=True) * 1.0
    call_args = (x,)
    best = float("inf")
    for _ in range(40):
        hooks.on_call(0, call_args, None, False)  # the step's first call
        call = hooks.on_call
        t0 = time.perf_counter_ns()
        for _ in range(400):
            call(0, call_args, None, False)
        best = min(best, time.perf_counter_ns() - t0)
        eff.drop()
    return best / 400 / 1e3


def peak_us() -> float:
    """StepEfficiency's peak lookup at a sampled step's end, the device named as an H100 (its
    name function replaced: there is no GPU to ask; on CUDA the real call adds to it)."""
    from hookprof._testing import peak_lookup
    from hookprof.efficiency import peaks

    peaks.device_name = lambda device: "NVIDIA H100 80GB HBM3"
    return best_us(peak_lookup(sampled_work_efficiency(None), "bf16"), 1000, 50)


def update_us() -> float:
    """UpdateNorms before + after an update, 80 x Linear(4, 4) (160 parameters, small: the
    Python around the norms shows)."""
    from hookprof.efficiency.updates import UpdateNorms
    from hookprof.layers import LayerTable

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(80)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = UpdateNorms(LayerTable(model), 1 << 30)

    def measure():
        norms.follow(opt)
        norms.before_update()
        norms.after_update()

    measure()
    return best_us(measure, 20, 30)


def counters_us() -> float:
    """What History.observe reads of StepCounters per fold."""
    from hookprof.step.record import StepCounters

    counters = StepCounters()
    for i in range(100):
        counters.observe(0.01 * (i % 7), float(i))
    return best_us(counters.latest, 10000, 20)


def sampled_work(args: argparse.Namespace) -> list[Table]:
    """Host cost of the work around a sampled step's hooks that is done once rather than per
    call (docs/sampled-step-work.md), each part timed alone, best of many repetitions: a
    layer call with FLOP counting on, the peak lookup at a sampled step's end, an update
    measurement, the step counters read per history fold."""
    torch.set_num_threads(1)
    table = Table("each part alone, best of many repetitions", [("us", ".3f")])
    table.add("layer call, forward(x), FLOP counting on", layer_call_us())
    table.add("peak lookup per sampled step (H100 name)", peak_us())
    table.add("update measurement, 160 parameters", update_us())
    table.add("step counters read per history fold", counters_us())
    return [table]


# ---------------------------------------------------------------- progress


def per_step_ns(body: Callable[[int], None], steps: int, rounds: int = 7) -> float:
    results = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        body(steps)
        results.append((time.perf_counter_ns() - t0) / steps)
    return statistics.median(results)


def progress(args: argparse.Namespace) -> list[Table]:
    """What the progress record costs the training thread per step: the stores a plain step
    makes at its boundaries (root forward, root output, optimizer pre and post, step end),
    side by side with an empty loop of the same shape and with the clock reads alone; and
    what a sampled step on CUDA adds to them: a device-timer mark per boundary
    (phases/device.py), here the real CudaEventTimer over tests/support/fake_gpu.py's stand-in
    events (their record() is Python, a real one is a C call: ~3 us on an H100 with the
    stream passed, DESIGN.md), including handing the 5 events back to the timer's pool,
    which the publisher thread does in real use. The full picture (a real model, with and
    without hookprof) is bench/compare_versions.py."""
    from hookprof.device.timing import CudaEventTimer
    from hookprof.phases.clock import BACKWARD, FORWARD, OPTIMIZER, OTHER, Progress
    from hookprof.phases.device import PhaseMarks
    from hookprof.step.record import StepRecord
    from support.fake_gpu import FakeEvent, FakeStream

    def empty(steps: int) -> None:
        for _ in range(steps):
            pass

    def clock_reads(steps: int) -> None:
        clock = time.perf_counter_ns
        for _ in range(steps):
            clock(), clock(), clock(), clock(), clock()

    # the two loops below spell out the same five boundaries on purpose: a shared helper
    # would put one more Python call in every timed step
    def progress_stores(steps: int) -> None:
        clock = time.perf_counter_ns
        record = Progress(clock())
        for number in range(1, steps + 1):
            record.enter(FORWARD, clock())
            record.enter(BACKWARD, clock())
            record.enter(OPTIMIZER, clock())
            record.enter(OTHER, clock())
            record.end_step(number, clock())

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

    base = per_step_ns(empty, args.steps)
    clocks = per_step_ns(clock_reads, args.steps) - base
    stores = per_step_ns(progress_stores, args.steps) - base
    marked = per_step_ns(progress_stores_with_device_marks, args.steps // 4) - base
    table = Table("per step, median of 7 runs", [("ns", ".0f")])
    table.add("5 clock reads", clocks)
    table.add("5 clock reads + progress stores", stores)
    table.add("progress stores alone", stores - clocks)
    table.add("... + 5 device marks (stand-ins)", marked)
    table.add("device marks alone, per boundary", (marked - stores) / 5)
    return [table]


def progress_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=200_000,
        help="loop iterations per run (a quarter of them with device marks)",
    )


# ---------------------------------------------------------------- efficiency


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def efficiency(args: argparse.Namespace) -> list[Table]:
    """What each efficiency feature (issue 15) costs on one sampled step, next to a plain
    training step of the same model (bench/overhead.py's workloads, CPU), median over
    --repeat runs: update norms (the copy before the update plus the weight and update
    squares after it), at the default byte cap and at a cap of a quarter of the model
    (layers take turns); FLOPs in the steady state (noting every layer call's signature, what
    StepEfficiency.listen sets LayerHooks.on_call to, plus the step's end: counts, totals,
    the peak); FLOPs at the first sight of a shape (counting one layer kind on meta tensors,
    once per kind and input signature, then cached). Off the sampled steps these features do
    nothing. Device-side work is synchronous on the CPU, so these are whole costs here; on a
    GPU the norms' kernels run asynchronously."""
    from overhead import WORKLOADS

    from hookprof._testing import flop_arguments
    from hookprof.efficiency.figures import StepEfficiency
    from hookprof.efficiency.flops import count
    from hookprof.efficiency.updates import UpdateNorms
    from hookprof.layers import LayerTable
    from hookprof.notices import Notices

    w = WORKLOADS[args.workload]
    torch.manual_seed(0)
    model = w.build()
    x = w.make_input(torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (w.batch,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    table = LayerTable(model)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    rows = {"training step (no hookprof)": median_ms(step, args.repeat)}
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for label, cap in (
        ("update norms, all layers", 256 * 2**20),
        ("update norms, cap = model/4", model_bytes // 4),
    ):
        norms = UpdateNorms(table, cap)

        def measure():
            norms.before_update()
            norms.after_update()

        rows[label] = median_ms(measure, args.repeat)

    # a step's layer calls, as LayerHooks reports them: (layer, args, kwargs, nested)
    calls = []
    handles = [
        layer.module.register_forward_pre_hook(
            lambda m, a, i=layer.index: calls.append((i, a, {}, False))
        )
        for layer in table.layers
    ]
    model(x)
    for h in handles:
        h.remove()
    eff = StepEfficiency(
        table,
        flops=True,
        update_norms=False,
        update_max_bytes=0,
        peak_flops=1e12,
        notices=Notices(),
    )
    hooks = types.SimpleNamespace(on_call=None)  # LayerHooks' attribute, called per layer call
    eff.listen(hooks)
    for call in calls:  # first sight: counted once
        hooks.on_call(*call)
    eff.end_step(1, time.perf_counter_ns(), 0.01)

    def steady():
        for call in calls:
            hooks.on_call(*call)
        eff.end_step(2, time.perf_counter_ns(), 0.01)

    rows[f"FLOPs, steady ({len(calls)} calls noted)"] = median_ms(steady, args.repeat)
    first = table.layers[0].module
    meta = flop_arguments(x)
    rows[f"FLOPs, first sight of one {type(first).__name__} shape"] = median_ms(
        lambda: count(first, meta, {}), 10
    )

    out = Table(
        f"{w.name}; {torch.get_num_threads()} torch threads; median of {args.repeat}; per sampled step",
        [("ms", ".3f"), ("x step", ".3f")],
    )
    base = rows["training step (no hookprof)"]
    for label, ms in rows.items():
        out.add(label, ms, ms / base)
    return [out]


def efficiency_options(parser: argparse.ArgumentParser) -> None:
    from overhead import WORKLOADS

    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--repeat", type=int, default=30)


# ---------------------------------------------------------------- closure-guard


def closure_model(width: int = 256, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


CLOSURE_OPTIMIZERS = {
    "SGD + closure (1 evaluation)": lambda m: torch.optim.SGD(
        m.parameters(), lr=1e-3, momentum=0.9
    ),
    "LBFGS max_iter=4 (4 evaluations)": lambda m: torch.optim.LBFGS(
        m.parameters(), lr=0.1, max_iter=4
    ),
}

CLOSURE_SETTINGS = {"none": None, "record": {}, "skip": {"on_nonfinite": "skip"}}


def closure_seconds_per_step(make_opt, settings: dict | None, steps: int) -> float:
    import hookprof

    model = closure_model()
    opt = make_opt(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    prof = hookprof.attach(model, port=0, **settings) if settings is not None else None
    try:
        for _ in range(5):  # warm-up
            opt.step(closure)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step(closure)
        return (time.perf_counter() - t0) / steps
    finally:
        if prof is not None:
            prof.detach()


def closure_guard(args: argparse.Namespace) -> list[Table]:
    """What on_nonfinite="skip" costs a closure step (optimizer.step(closure)) next to
    "record": under skip/raise the guard judges each evaluation of the closure as it returns
    (one per-layer gradient reduction per evaluation, LBFGS making up to max_eval of them
    per step), under record the gradients are read once per step. Side by side, in one run,
    rounds interleaved so that drifts in machine load hit all alike: the median step time per
    configuration and its ratio to no hookprof."""
    torch.set_num_threads(1)
    table = Table(
        f"9-layer MLP, width 256, batch 64; median of {args.rounds} interleaved rounds "
        f"of {args.steps} steps",
        [("ms/step", ".3f"), ("vs none", ".3f")],
    )
    for name, make_opt in CLOSURE_OPTIMIZERS.items():
        times: dict[str, list[float]] = {key: [] for key in CLOSURE_SETTINGS}
        for _ in range(args.rounds):
            for key, settings in CLOSURE_SETTINGS.items():
                times[key].append(closure_seconds_per_step(make_opt, settings, args.steps))
        base = statistics.median(times["none"])
        for key in CLOSURE_SETTINGS:
            t = statistics.median(times[key])
            table.add(f"{name}, {key}", t * 1e3, t / base)
        table.add(
            f"{name}, skip/record",
            None,
            statistics.median(times["skip"]) / statistics.median(times["record"]),
        )
    return [table]


def closure_guard_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of every configuration"
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="timed steps per configuration and round"
    )


# ---------------------------------------------------------------- guard-device


GUARD_RARELY = dict(port=0, sample_every=1000, min_sample_interval_s=3600.0)  # step 1 only

GUARD_CONFIGS = {  # label: (on_nonfinite, optimizer, nonfinite_sync)
    "record, SGD": ("record", "sgd", False),
    "skip, SGD": ("skip", "sgd", False),
    "skip, fused Adam": ("skip", "fused", False),
    "skip, SGD, nonfinite_sync": ("skip", "sgd", True),
    "record, SGD, nonfinite_sync": ("record", "sgd", True),
}


def guard_measure(label: str, depth: int, steps: int, lag: int) -> tuple[int, float, float]:
    """(ATen ops, waits, host us) hookprof adds to one unsampled step under one configuration."""
    import copy

    from host_cost import BoundaryMeter

    import hookprof
    from support.lagging_device import lagging_device
    from support.models import DeepNet, loss_of, seeded
    from support.op_counter import OpCounter

    policy, kind, sync = GUARD_CONFIGS[label]

    def make_opt(model) -> torch.optim.Optimizer:
        if kind == "fused":
            return torch.optim.Adam(model.parameters(), lr=0.0, fused=True)
        return torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step is the same step

    def one_step(model, opt, batch) -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        opt.step()

    base = seeded(DeepNet, depth=depth)
    batch = base.batch(torch.Generator().manual_seed(0))
    bare, watched = base, copy.deepcopy(base)
    bare_opt, watched_opt = make_opt(bare), make_opt(watched)
    meter = BoundaryMeter(clock=time.thread_time_ns)
    meter.install()
    try:
        with lagging_device(lag) as device:
            prof = hookprof.attach(
                watched, **GUARD_RARELY, on_nonfinite=policy, nonfinite_sync=sync
            )
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
    return ops, waits, statistics.median(per_step_us)


def guard_device(args: argparse.Namespace) -> list[Table]:
    """What the NaN/Inf policies cost per unsampled step on a device that runs behind the
    host, emulated on the CPU (tests/support/lagging_device.py: output, loss and gradient checks stay
    device flags, one-value copies arrive --lag steps late), so the accelerator code paths of
    the update guard and the forward replay run here. Per configuration (policy, optimizer,
    nonfinite_sync): ops, the ATen ops hookprof adds to one unsampled step (with it, less
    without it, on copies of one model), each a kernel launch on a GPU; waits, the training
    thread's waits for the device per step, as the emulation sees them; us, host CPU
    microseconds spent in hookprof's step-boundary methods per unsampled step
    (bench/host_cost.py's BoundaryMeter; the thread's CPU time, torch on one thread). The
    gradients take their accelerator path (one fused reduction, not a CPU dot per tensor)."""
    from hookprof.step import gradients

    torch.set_num_threads(1)  # every op on the timed thread
    gradients.GradientNorms.cpu_dot_per_tensor = False  # the accelerator's reduction, as on a GPU
    table = Table(
        f"an emulated device {args.lag} steps behind, DeepNet depth {args.depth}, {args.steps} steps",
        [("ops", "d"), ("waits/step", ".2f"), ("us", ".0f")],
    )
    for label in GUARD_CONFIGS:
        table.add(label, *guard_measure(label, args.depth, args.steps, args.lag))
    return [table]


def guard_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--depth", type=int, default=8, help="DeepNet blocks")
    parser.add_argument(
        "--steps", type=int, default=200, help="timed unsampled steps per configuration"
    )
    parser.add_argument("--lag", type=int, default=3, help="optimizer steps the device runs behind")


# ---------------------------------------------------------------- the parts, one printer


@dataclass(frozen=True)
class Part:
    what: str  # a line for --help
    run: Callable[[argparse.Namespace], list[Table]]
    options: Callable[[argparse.ArgumentParser], None]
    was: str  # the command this part replaces, for readers of figures measured with it
    processes: int  # with --against: processes per version, by default


def no_options(parser: argparse.ArgumentParser) -> None:
    pass


PARTS = {
    "leaf": Part(
        "host time per instrumented leaf of a sampled step's hooks",
        leaf,
        leaf_options,
        "python bench/leaf_cost.py [--steps N] [--against REV --rounds N]",
        4,
    ),
    "leaf-marks": Part(
        "timer marks, hook calls and Python calls per leaf, counted",
        leaf_marks,
        leaf_marks_options,
        "python bench/leaf_marks.py (another version: HOOKPROF_ROOT=DIR python bench/leaf_marks.py)",
        1,
    ),
    "sampled-work": Part(
        "a sampled step's once-per-step work, each piece alone",
        sampled_work,
        no_options,
        "python bench/sampled_work.py [--against REV --rounds N]",
        3,
    ),
    "progress": Part(
        "the step phases' stores and device marks per step",
        progress,
        progress_options,
        "python bench/progress_cost.py",
        2,
    ),
    "efficiency": Part(
        "update norms and FLOP counting per sampled step",
        efficiency,
        efficiency_options,
        "python bench/efficiency_cost.py [--workload W] [--repeat N]",
        2,
    ),
    "closure-guard": Part(
        'on_nonfinite="skip" on closure steps (SGD, LBFGS)',
        closure_guard,
        closure_guard_options,
        "python bench/closure_guard_cost.py [--rounds N] [--steps N]",
        2,
    ),
    "guard-device": Part(
        "NaN/Inf policies per unsampled step, device emulated behind the host",
        guard_device,
        guard_device_options,
        "python bench/guard_device_cost.py [--depth N] [--steps N] [--lag N] [--against REV]",
        1,
    ),
}


def cell(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return format(round(value) if spec == "d" else value, spec)


def print_tables(runs: dict[str, list[dict]]) -> None:
    """Every table of a part's results: {version: [one process's result, ...]}, each cell the
    median over that version's processes. One version: the tables as they are. Two: a line
    per cell, the versions side by side and the second over the first."""
    labels = list(runs)
    processes = len(runs[labels[0]])
    for label, results in runs.items():
        print(f"# {label}: hookprof from {results[0]['hookprof']}, {len(results)} process(es)")
    for t, first in enumerate(runs[labels[0]][0]["tables"]):
        columns = [tuple(c) for c in first["columns"]]
        rows = list(first["rows"])
        for results in runs.values():  # rows only one version has, after the others
            rows += [r for r in results[0]["tables"][t]["rows"] if r not in rows]

        def median(label: str, row: str, c: int) -> float | None:
            values = [
                r["tables"][t]["rows"].get(row, [None] * len(columns))[c] for r in runs[label]
            ]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        print(
            f"\n## {first['title']}"
            + (f" (medians over {processes} processes)" if processes > 1 else "")
        )
        if len(labels) == 1:
            print("| | " + " | ".join(name for name, _ in columns) + " |")
            print("|---|" + "---|" * len(columns))
            for row in rows:
                print(
                    f"| {row} | "
                    + " | ".join(
                        cell(median(labels[0], row, c), spec) for c, (_, spec) in enumerate(columns)
                    )
                    + " |"
                )
            continue
        print("| | | " + " | ".join(labels) + " | ratio |")
        print("|---|---|" + "---|" * (len(labels) + 1))
        for row in rows:
            for c, (name, spec) in enumerate(columns):
                values = [median(label, row, c) for label in labels]
                if all(v is None for v in values):
                    continue
                old, new = values[0], values[-1]
                ratio = f"{new / old:.3f}" if old and new is not None else "-"
                print(
                    f"| {row} | {name} | "
                    + " | ".join(cell(v, spec) for v in values)
                    + f" | {ratio} |"
                )


def run_part(part: Part, args: argparse.Namespace) -> dict:
    checkout = paths.hookprof_checkout()
    tables = part.run(args)
    return {
        "hookprof": checkout,
        "tables": [{"title": t.title, "columns": t.columns, "rows": t.rows} for t in tables],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, part in PARTS.items():
        sub = subparsers.add_parser(
            name,
            help=part.what,
            description=f"{inspect.cleandoc(part.run.__doc__)}\n\nReplaces: {part.was}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        part.options(sub)
        sub.add_argument(
            "--against", metavar="REV", help="also run a git revision (in a temporary worktree)"
        )
        sub.add_argument(
            "--processes",
            type=int,
            default=part.processes,
            help="with --against: processes per version, alternating (default %(default)s)",
        )
        sub.add_argument("--json", help="write this process's figures here, print nothing")
    args = parser.parse_args(argv)
    part = PARTS[args.part]
    if args.json and not args.against:  # a process of --against (or a caller that reads JSON)
        with open(args.json, "w") as f:
            json.dump(run_part(part, args), f)
        return 0
    print(
        f"# bench/parts.py {args.part}: torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{datetime.date.today().isoformat()}",
        flush=True,
    )
    if args.against:
        from compare_versions import alternate, without

        runs = alternate(
            __file__,
            args.against,
            args.processes,
            without(argv, "--against", "--processes", "--json"),
        )
    else:
        runs = {"this checkout": [run_part(part, args)]}
    print_tables(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
