"""The first NaN under torch.compile (issue 30): a data row that overflows layer `0`'s forward
at step 7 is counted in the forward, at step 7, and its producer named by the replay as on the
same model run eagerly; with aot_eager and inductor, fullgraph or not, compiled whole
(torch.compile(model), model.compile()) or block by block (regional compilation). hookprof adds
no graph break and compiles nothing after the first step that the run without it does not
(torch._dynamo's counters), and training stays bit-identical."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import hookprof
from hookprof.serve.exporter import render
from support.compiled import OverflowNet as Net
from support.compiled import compiled_so_far

BAD_STEP = 7
STEPS = 10


def compile_model(model: nn.Module, how: str, backend: str, fullgraph: bool):
    """What the loop calls: the model compiled `how` ("eager": not at all)."""
    if how == "eager":
        return model
    if how in ("whole", "whole, then attach"):
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    if how == "in place":
        model.compile(backend=backend, fullgraph=fullgraph)
        return model
    assert how == "regional"
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    return model


def run(how: str, backend: str, fullgraph: bool, attach: bool, poison=None):
    """Train STEPS steps, the batch of BAD_STEP with a row that overflows `inp`. Returns
    (the parameters, the first non-finite event, the non-finite step counts, Dynamo's
    counts: graph breaks, frames and graphs compiled in all, and after step 2)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if how == "whole, then attach":  # torch.compile(model), then attach(the compiled model)
        call = compile_model(model, how, backend, fullgraph)
        prof = hookprof.attach(call, port=0, summary_at_exit=False) if attach else None
    else:
        prof = hookprof.attach(model, port=0, summary_at_exit=False) if attach else None
        call = compile_model(model, how, backend, fullgraph)
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(1, STEPS + 1):
            x = torch.randn(4, 8, generator=gen)
            if step == BAD_STEP and poison is None:
                x[0] = 3e38
            elif step == BAD_STEP:
                poison(model)
            opt.zero_grad()
            call(x).square().mean().backward()
            opt.step()
            if step == 2:
                warm = compiled_so_far()
        dynamo = (
            sum(counters["graph_break"].values()),
            compiled_so_far(),
            compiled_so_far() - warm,
        )
        event = counts = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
            assert snap.internal_errors == 0 and snap.step == STEPS
            event, counts = snap.first_nonfinite, dict(snap.nonfinite_steps)
        return [p.detach().clone() for p in model.parameters()], event, counts, dynamo
    finally:
        if prof is not None:
            prof.detach()


def bits(params):
    return [p.view(torch.int32) for p in params]  # NaN-aware: the very same bits


def event_of(event):
    return (event.layer, event.phase, event.step, event.found_by, event.replay)


CASES = [
    ("whole", "aot_eager", False),
    ("whole", "aot_eager", True),
    ("whole, then attach", "aot_eager", False),
    ("in place", "aot_eager", False),
    ("regional", "aot_eager", True),
    pytest.param("whole", "inductor", False, marks=pytest.mark.slow),
    pytest.param("regional", "inductor", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("how,backend,fullgraph", CASES)
def test_a_forward_overflow_under_compile_is_named_as_in_eager_mode(how, backend, fullgraph):
    _, eager_event, eager_counts, _ = run("eager", backend, fullgraph, attach=True)
    assert event_of(eager_event) == ("inp", "forward", BAD_STEP, "replay", "reproducible")

    plain, _, _, plain_dynamo = run(how, backend, fullgraph, attach=False)
    params, event, counts, dynamo = run(how, backend, fullgraph, attach=True)
    assert event_of(event) == event_of(eager_event)
    assert counts == eager_counts and counts["forward"] >= 1
    # no graph break, nothing compiled after warm-up (no recompile), as without hookprof
    assert dynamo[0] == plain_dynamo[0] == 0
    assert dynamo[2] == plain_dynamo[2] == 0
    if how == "regional":  # the compiled blocks are left alone: the very same frames
        assert dynamo[1] == plain_dynamo[1]
    assert [torch.equal(a, b) for a, b in zip(bits(plain), bits(params))] == [True] * len(plain)


def poison_block_weight(model):
    with torch.no_grad():
        model.blocks[1].fc1.weight[0, 0] = float("nan")


@pytest.mark.parametrize("how", ["whole", "regional"])
def test_a_nan_weight_under_compile_is_named_as_in_eager_mode(how):
    _, eager_event, eager_counts, _ = run(
        "eager", "aot_eager", False, attach=True, poison=poison_block_weight
    )
    assert eager_event.layer == "blocks.1.fc1" and eager_event.phase == "forward"
    _, event, counts, _ = run(how, "aot_eager", False, attach=True, poison=poison_block_weight)
    assert event_of(event) == event_of(eager_event) and counts == eager_counts


def regional_run(
    compile_blocks,
    *,
    attach: bool,
    fullgraph: bool,
    backend: str = "aot_eager",
    attach_first: bool = True,
    steps: int = 8,
    **extra,
):
    """Train `steps` steps of Net, every other one sampled, its blocks compiled by
    `compile_blocks(model, backend, fullgraph)` after attach (or before, `attach_first=False`).
    Returns (parameters, snapshot or None, compiled after step 1, graph breaks, the page and
    the report's document, graphs compiled in step 1)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    settings = dict(
        port=0, summary_at_exit=False, sample_every=2, min_sample_interval_s=0.0, **extra
    )
    if not attach_first:
        compile_blocks(model, backend, fullgraph)
    prof = hookprof.attach(model, **settings) if attach else None
    if attach_first:
        compile_blocks(model, backend, fullgraph)
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=gen) * 0.1).square().mean().backward()  # finite
            opt.step()
            if step == 1:
                warm = compiled_so_far()
                first_graphs = counters["stats"]["unique_graphs"]  # compiled inside step 1's calls
        snap = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
            page = {"metrics": render(prof.registry).decode(), "report": prof.report_document()}
    finally:
        if prof is not None:
            prof.detach()
    params = [p.detach().clone() for p in model.parameters()]
    return (
        params,
        snap,
        compiled_so_far() - warm,
        sum(counters["graph_break"].values()),
        (page if attach else None),
        first_graphs,
    )


def blocks_compiled_in_place(model, backend, fullgraph):
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)


def blocks_replaced_by_compiled(model, backend, fullgraph):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)


REGIONAL = [
    (blocks_compiled_in_place, False, "aot_eager", True),
    (blocks_compiled_in_place, True, "aot_eager", True),
    (blocks_compiled_in_place, True, "aot_eager", False),
    (blocks_replaced_by_compiled, False, "aot_eager", True),
    (blocks_replaced_by_compiled, True, "aot_eager", False),
    pytest.param(blocks_compiled_in_place, True, "inductor", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("compile_blocks,fullgraph,backend,attach_first", REGIONAL)
def test_regional_compilation_times_each_compiled_block_as_one_row(
    compile_blocks, fullgraph, backend, attach_first
):
    """Blocks compiled one by one (module.compile(), or torch.compile(block) put in its
    place; before or after attach): each block's call is timed from outside its graph as one
    row named as the block (module `ResidualBlock`), forward and backward, on every sampled step but
    the one that compiled it (its time is compilation); the layers between the blocks are
    timed as layers; the blocks' own layers are not (they run inside the graph). Nothing is
    compiled after the first step, no graph break, training bit-identical to the same run
    without hookprof; the model's FLOPs per step equal the eager run's (the blocks counted
    as units), and the rows are on the page."""
    plain, _, plain_compiled, plain_breaks, _, _ = regional_run(
        compile_blocks,
        attach=False,
        fullgraph=fullgraph,
        backend=backend,
        attach_first=attach_first,
    )
    params, snap, compiled, breaks, page, first_graphs = regional_run(
        compile_blocks, attach=True, fullgraph=fullgraph, backend=backend, attach_first=attach_first
    )
    _, eager, _, _, _, _ = regional_run(lambda *a: None, attach=True, fullgraph=fullgraph)
    assert snap.internal_errors == 0
    assert compiled == plain_compiled == 0 and breaks == plain_breaks == 0
    assert all(torch.isfinite(p).all() for p in params)
    assert [torch.equal(a, b) for a, b in zip(bits(plain), bits(params))] == [True] * len(plain)
    sampled = snap.sampled_steps
    assert sampled == 4 and first_graphs >= 1
    layers = snap.layers
    timed = 0
    for k in range(2):
        row = layers[f"blocks.{k}"]
        assert row.module == "ResidualBlock" or (
            row.module == "OptimizedModule" and not attach_first
        )
        # step 1 was sampled: a block call inside which Dynamo compiled is not timed (its
        # time is compilation); the other block, served by the same graph, is
        assert sampled - 1 <= row.forward_calls_total == row.backward_calls_total <= sampled, row
        timed += row.forward_calls_total
        assert row.forward_seconds_total > 0 and row.backward_seconds_total > 0
        assert row.grad_norm is None and row.activation_abs_max is None
        for inner in ("fc1", "act", "fc2"):
            inside = [
                s
                for n, s in layers.items()
                if n in (f"blocks.{k}.{inner}", f"blocks.{k}._orig_mod.{inner}")
            ]
            assert len(inside) == 1 and inside[0].forward_calls_total == 0, inside
        assert (
            f'hookprof_layer_forward_seconds_count{{layer="blocks.{k}",model="OverflowNet",module="{row.module}",'
            f'rank="0"}} {float(row.forward_calls_total)}'
        ) in page["metrics"]
        # the report follows it like a layer: a series of forward times, one value per timed step
        (series,) = [s for s in page["report"]["history"]["layers"] if s["name"] == f"blocks.{k}"]
        assert (
            sum(v is not None and v > 0 for v in series["forward_seconds"])
            == row.forward_calls_total
        )
    assert timed == 2 * sampled - first_graphs
    for outside in ("inp", "out"):
        assert layers[outside].forward_calls_total == sampled
    # the blocks' FLOPs counted as units: the model's per step as in the eager run
    assert snap.efficiency.flops_per_step == eager.efficiency.flops_per_step > 0


@pytest.mark.parametrize("fullgraph", [False, True])
def test_regional_compilation_gets_the_blocks_layers_statistics_from_an_eager_rerun(fullgraph):
    """Sampled steps with activation checks: the layers inside the compiled blocks get
    their activation abs max and zero ratio from an eager no_grad re-run of the step's
    forward at its update, equal to the eager run's; the layers around them from the step
    itself (the same values); the re-run's times are not counted (the blocks' layers show no
    calls), nothing is recompiled and training stays bit-identical."""
    every = dict(activation_interval_s=0.0)
    plain, _, _, _, _, _ = regional_run(blocks_compiled_in_place, attach=False, fullgraph=fullgraph)
    params, snap, compiled, _, _, _ = regional_run(
        blocks_compiled_in_place, attach=True, fullgraph=fullgraph, **every
    )
    _, eager, _, _, _, _ = regional_run(lambda *a: None, attach=True, fullgraph=fullgraph, **every)
    assert snap.internal_errors == 0 and compiled == 0
    assert [torch.equal(a, b) for a, b in zip(bits(plain), bits(params))] == [True] * len(plain)
    for name, e in eager.layers.items():
        s = snap.layers[name]
        assert e.activation_abs_max is not None, name
        assert s.activation_abs_max == pytest.approx(e.activation_abs_max, rel=1e-6), name
        assert s.activation_zero_ratio == e.activation_zero_ratio, name
        if name.startswith("blocks."):
            assert s.forward_calls_total == 0, name  # the re-run's calls are not timed
        else:
            assert s.forward_calls_total == eager.layers[name].forward_calls_total == 4, name


class DropoutNet(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.inp, self.drop, self.out = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 1)
        with torch.no_grad():
            self.inp.weight.mul_(10)

    def forward(self, x):
        return self.out(self.drop(self.inp(x)))


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_a_finite_replay_of_a_compiled_forward_that_draws_random_numbers_is_not_called_transient(p):
    """The bad row is zeroed after the backward (before the update, when the replay runs),
    so the replay is finite: transient without dropout; with dropout active the compiled
    forward drew random numbers the eager replay cannot be sure to draw again (inductor
    generates its own), so it is "not replayed", and says why."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DropoutNet(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookprof.attach(model, port=0, summary_at_exit=False) as prof:
        call = torch.compile(model, backend="aot_eager")
        for step in range(1, 6):
            x = torch.randn(4, 8)
            if step == 3:
                x[0] = 3e38
            opt.zero_grad()
            call(x).square().mean().backward()
            x[0] = 0.0  # what the replay will see
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert (event.phase, event.step) == ("forward", 3)
    if p == 0.0:
        assert event.replay == "transient"
    else:
        assert event.replay == "not replayed" and "random numbers" in event.replay_note


class StatsNet(nn.Module):
    """BatchNorm (buffers the re-run must leave alone) and dropout (RNG it must put back)."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.act = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()
        self.drop, self.out = nn.Dropout(0.1), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(self.act(self.norm(self.inp(x)))))


def stats_run(how: str, attach: bool):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = StatsNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    settings = dict(
        port=0,
        summary_at_exit=False,
        sample_every=2,
        min_sample_interval_s=0.0,
        activation_interval_s=0.0,
    )
    prof = hookprof.attach(model, **settings) if attach else None
    call = compile_model(model, how, "aot_eager", False) if how != "regional" else model
    if how == "regional":
        model.norm.compile(backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout masks
    layers = None
    try:
        for step in range(1, 8):
            opt.zero_grad()
            call(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
            if step == 2:
                frames_warm = compiled_so_far()
        if prof is not None:
            prof.flush()
            layers = prof.snapshot().layers
            assert prof.snapshot().internal_errors == 0
    finally:
        if prof is not None:
            prof.detach()
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    return state, layers, compiled_so_far() - frames_warm


@pytest.mark.parametrize("how", ["whole", "regional"])
def test_sampled_steps_of_a_compiled_model_get_activation_statistics_from_an_eager_rerun(how):
    """The last sampled step's activation abs max and zero ratio per layer are those of the
    same run eager (the re-run is the step's forward on its own weights and inputs); its
    eager times are not counted; training stays bit-identical (BatchNorm statistics and the
    dropout RNG put back) and nothing is compiled after warm-up."""
    _, eager, _ = stats_run("eager", attach=True)
    plain, _, _ = stats_run(how, attach=False)
    state, layers, recompiled = stats_run(how, attach=True)
    assert [torch.equal(a, b) for a, b in zip(plain, state)] == [True] * len(plain)
    assert recompiled == 0
    # block by block: the BatchNorm compiled on its own is a layer called from outside its
    # graph, timed and checked by the step's own hooks like the others (no re-run)
    for name, s in layers.items():
        e = eager[name]
        assert s.activation_abs_max == pytest.approx(e.activation_abs_max, rel=1e-6), name
        assert s.activation_zero_ratio == e.activation_zero_ratio, name
    if how == "whole":  # nothing timed inside the graph, and the re-run's times are not counted
        assert {s.forward_calls_total for s in layers.values()} == {0}
    else:  # every layer is timed on the sampled steps, the compiled BatchNorm from outside its
        # graph (but not on a step that compiled it: torch 2.13's Dynamo skips a torch.nn
        # module's own frames, so nothing may be compiled at all)
        assert layers["inp"].forward_calls_total == 4 and layers["norm"].forward_calls_total in (
            3,
            4,
        )


@pytest.fixture
def dynamo_folds_is_exporting_to_true(monkeypatch):
    """Dynamo as in torch <= 2.12: `torch.compiler.is_exporting()` traced to the constant True
    in every trace, torch.compile's too (the first GPU run's torch 2.11 did; 2.13 reads the
    flag). Emulated by replacing Dynamo's handler for that one function, where this torch has
    the handler table; elsewhere the test runs on the torch as it is."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    handlers = getattr(TorchInGraphFunctionVariable, "_get_handlers", None)
    if handlers is None or torch.compiler.is_exporting not in handlers():
        yield False
        return
    table = handlers()
    monkeypatch.setitem(
        table, torch.compiler.is_exporting, lambda self, tx, *a, **k: ConstantVariable.create(True)
    )
    torch._dynamo.reset()
    yield True
    torch._dynamo.reset()


def test_a_forward_overflow_is_seen_where_dynamo_calls_every_trace_an_export(
    dynamo_folds_is_exporting_to_true,
):
    """hookprof's root hooks tell torch.export from torch.compile by the flag itself: with
    is_exporting() folded to True, the hooks took every compiled trace for an export and left
    the output check out, so the forward NaN read as layer `out`, backward (11 tests failed
    on torch 2.11; this one fails on 2.13 without the fix)."""
    _, event, counts, dynamo = run("whole", "aot_eager", True, attach=True)
    assert event_of(event) == ("inp", "forward", BAD_STEP, "replay", "reproducible")
    assert counts["forward"] >= 1 and dynamo[0] == 0 and dynamo[2] == 0


def test_the_counters_are_static_inputs_so_cuda_graphs_keep_the_graph():
    """Under mode="reduce-overhead" inductor skips the CUDA graph of any graph that updates
    an input in place, unless that input is static (a parameter, a buffer, a tensor marked
    with mark_static_address): the counters the traced check adds to are marked so (the
    first GPU run counted one CUDA-graph skip with hookprof, none without). What torch's own
    machinery says, on the CPU: AOTAutograd lists them among the static inputs."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("torch._functorch._aot_autograd.frontend_utils")
    handler = Keep(logging.DEBUG)
    torch._logging.set_logs(cudagraph_static_inputs=True)
    logger.addHandler(handler)
    try:
        _, event, _, _ = run("whole", "aot_eager", True, attach=True)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert event.phase == "forward"
    assert any(
        m.startswith("Adding static input") and m.endswith("._traced.counts") for m in said
    ), said
