"""Regional compilation (blocks compiled one by one) with the loops and models users write:
blocks that own a parameter of their own, blocks that keep state outside their buffers, a
block on the raw input, nested compiled modules, a leaf compiled alone, two updates per step,
closure optimizers, the layer budget. Each case came from an independent review of the
regional-compilation change (2026-11-27) and failed before its fix; the reference is always
the same model run eagerly, or compiled without hookprof."""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import hookprof
import hookprof.nonfinite.checks as checks
from support.compiled import compiled_so_far

EVERY_STEP = dict(
    port=0,
    summary_at_exit=False,
    min_sample_interval_s=0.0,
    activation_interval_s=0.0,
    sample_every=1,
)


class Overflow(nn.Module):
    """inf where the input is large (the bad row), else the input: a data-dependent NaN."""

    def forward(self, x):
        return torch.where(x.abs() > 1e3, x * 1e38, x)


class Block(nn.Module):
    def __init__(self, overflow: bool = False, own_param: bool = False, state: bool = False):
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(16, 32),
            Overflow() if overflow else nn.GELU(),
            nn.Linear(32, 16),
        )
        # a parameter of its own beside its children makes the block a layer of its own
        self.scale = nn.Parameter(torch.ones(16)) if own_param else None
        self.seen = torch.zeros(()) if state else None  # a plain tensor attribute, not a buffer

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(x)))
        if self.scale is not None:
            y = y * self.scale
        if self.seen is not None:
            self.seen.add_(1)
            y = y * torch.clamp(self.seen / 10, max=1.0)
        return x + y


class Net(nn.Module):
    def __init__(self, **block):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(**block), Block(overflow=True, **block)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def compile_blocks(model):
    for block in model.blocks:
        block.compile(backend="aot_eager")


def train(make, compile_fn, *, attach=True, steps=8, bad_step=None, **settings):
    """Train `steps` steps (the batch of `bad_step` with a row that overflows in blocks.1.act).
    Returns (parameters, snapshot, what Dynamo compiled after step 2, the model)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 if bad_step is None else 0.0)
    prof = hookprof.attach(model, **{**EVERY_STEP, **settings}) if attach else None
    compile_fn(model)
    gen = torch.Generator().manual_seed(1)
    warm = 0
    try:
        for step in range(1, steps + 1):
            x = torch.randn(4, 8, generator=gen) * 0.1
            if step == bad_step:
                x[0] = 1e6
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if step == 2:
                warm = compiled_so_far()
        snap = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
            assert snap.internal_errors == 0
    finally:
        if prof is not None:
            prof.detach()
    return [p.detach().clone() for p in model.parameters()], snap, compiled_so_far() - warm, model


def test_a_nan_in_a_compiled_block_that_is_a_layer_is_named_as_in_eager_mode():
    """A block with a parameter of its own is a layer; compiled alone, its children run in its
    graph. Its own output was checked on sampled steps, so it (`blocks.1`) was named instead
    of the layer inside it that made the NaN (`blocks.1.act`, as eager mode names it)."""
    _, eager, _, _ = train(lambda: Net(own_param=True), lambda m: None, bad_step=5)
    _, regional, _, _ = train(lambda: Net(own_param=True), compile_blocks, bad_step=5)
    assert (eager.first_nonfinite.layer, eager.first_nonfinite.step) == ("blocks.1.act", 5)
    assert regional.first_nonfinite.layer == eager.first_nonfinite.layer
    assert regional.first_nonfinite.propagators == eager.first_nonfinite.propagators


def test_a_compiled_block_that_is_a_layer_compiles_once():
    """block.compile() on a block that owns a parameter: its children got forward wrappers on
    sampled steps, which Dynamo guards on, so every sampled step recompiled the block (up
    to the recompile limit, then ran it eagerly). Now nothing is compiled after warm-up."""
    _, _, plain, _ = train(lambda: Net(own_param=True), compile_blocks, attach=False, steps=12)
    _, snap, compiled, _ = train(
        lambda: Net(own_param=True), compile_blocks, steps=12, sample_every=2
    )
    assert plain == compiled == 0
    assert snap.layers["blocks.0"].forward_calls_total >= 5  # timed as one row


def test_two_updates_in_one_step_keep_the_step_s_own_record():
    """prof.step() ends the step; two updates inside it, each after a forward of its own (a
    GAN's discriminator and generator). The first update's re-run was recorded into the
    step's record: its eager calls were counted as timed ones, and it took the step's
    parameter hooks, so the second forward's first layer lost its backward."""

    def run(compile_fn):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        first = torch.optim.SGD(
            list(model.inp.parameters()) + list(model.blocks.parameters()), lr=0.01
        )
        second = torch.optim.SGD(model.out.parameters(), lr=0.01)
        with hookprof.attach(model, **EVERY_STEP) as prof:
            compile_fn(model)
            gen = torch.Generator().manual_seed(1)
            for _ in range(6):
                for opt in (first, second):
                    opt.zero_grad()
                    loss = model(torch.randn(4, 8, generator=gen) * 0.1).square().mean()
                    loss.backward()
                    opt.step()
                prof.step(loss)
            prof.flush()
            return prof.snapshot()

    eager, regional = run(lambda m: None), run(compile_blocks)
    assert "(root)" not in regional.layers
    assert regional.layers["blocks.0.fc1"].forward_calls_total == 0
    for name in ("inp", "out"):
        e, r = eager.layers[name], regional.layers[name]
        assert (r.forward_calls_total, r.backward_calls_total) == (
            e.forward_calls_total,
            e.backward_calls_total,
        )


def test_state_kept_outside_the_buffers_is_left_as_it_was():
    """A block that counts its calls in a plain tensor attribute: the re-run of checked
    sampled steps (and the FLOP count's copy on meta tensors, which shared the attribute)
    advanced it too, and training diverged from the run without hookprof."""
    plain, _, _, without = train(lambda: Net(state=True), compile_blocks, attach=False)
    params, _, _, with_hookprof = train(lambda: Net(state=True), compile_blocks, sample_every=2)
    assert with_hookprof.blocks[0].seen.item() == without.blocks[0].seen.item() == 8
    assert all(torch.equal(a, b) for a, b in zip(plain, params))


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 16), nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class StemNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.out = Stem(), Block(), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.block(self.stem(x)))


def test_a_compiled_block_on_the_raw_input_has_its_backward_timed():
    """The stem takes the data, which needs no gradient: its backward ends at its
    parameters' last gradient (it had no end, so no backward time)."""

    def compile_both(model):
        model.stem.compile(backend="aot_eager")
        model.block.compile(backend="aot_eager")

    _, snap, _, _ = train(StemNet, compile_both)
    stem = snap.layers["stem"]
    assert stem.forward_calls_total >= 7
    assert stem.backward_calls_total == stem.forward_calls_total and stem.backward_seconds_total > 0


def test_a_compiled_block_with_a_compiled_child_has_its_flops_counted():
    """A child put in torch.compile's wrapper inside a block that is compiled too: the
    block's copy on meta tensors failed on the wrapper, and the model lost the blocks' FLOPs."""

    def nested(model):
        for i, block in enumerate(model.blocks):
            block.fc1 = torch.compile(block.fc1, backend="aot_eager")
            model.blocks[i] = torch.compile(block, backend="aot_eager")

    _, eager, _, _ = train(Net, lambda m: None)
    _, regional, _, _ = train(Net, nested)
    assert regional.efficiency.flops_per_step == eager.efficiency.flops_per_step > 0
    assert not [n for n in regional.notices if "cannot be counted" in n]


def test_a_leaf_compiled_alone_is_checked_as_itself_without_a_rerun():
    """Only `out` compiled: every layer is seen by the step's own hooks, `out` from outside
    its graph, so no step re-runs the forward."""
    reruns = []
    original = checks.forward_again

    def counting(*args, **kwargs):
        reruns.append(1)
        return original(*args, **kwargs)

    checks.forward_again = counting
    try:
        _, snap, _, _ = train(Net, lambda m: m.out.compile(backend="aot_eager"))
    finally:
        checks.forward_again = original
    assert reruns == []
    assert (
        snap.layers["out"].activation_abs_max is not None
        and snap.layers["out"].forward_calls_total >= 7
    )


def test_a_closure_optimizer_gets_the_blocks_statistics():
    """LBFGS runs the forward inside optimizer.step: the re-run was asked for at the update's
    start, before the closure's forward, so the blocks' layers never had statistics."""

    def run(compile_fn):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
        with hookprof.attach(model, **EVERY_STEP) as prof:
            compile_fn(model)
            gen = torch.Generator().manual_seed(1)
            for _ in range(4):
                x = torch.randn(4, 8, generator=gen) * 0.1

                def closure():
                    opt.zero_grad()
                    loss = model(x).square().mean()
                    loss.backward()
                    return loss

                opt.step(closure)
            prof.flush()
            return prof.snapshot()

    eager, regional = run(lambda m: None), run(compile_blocks)
    for name in ("blocks.0.fc1", "blocks.1.fc2"):
        # eagerly every closure call is seen (the largest over the line search's calls); the
        # re-run is of the first (the step's weights before LBFGS moves them): close, not equal
        e, r = eager.layers[name].activation_abs_max, regional.layers[name].activation_abs_max
        assert e is not None and r is not None and 0 < r <= e * 1.01, (name, e, r)


def test_block_rows_do_not_push_layers_off_the_page():
    """max_layers equal to the model's 8 layers: the two block rows counted against it and
    two layers left the page."""
    _, snap, _, _ = train(Net, compile_blocks, sample_every=2, max_layers=8)
    layers = {n for n in snap.layers if n not in ("blocks.0", "blocks.1")}
    assert len(layers) == 8
    assert set(snap.exported_layers) == layers | {"blocks.0", "blocks.1"}


def test_the_spike_replay_adds_no_graph_break_and_does_not_replay_compiled_blocks():
    """Found by review: the spike replay's wrappers (step/output_sums.py) stayed inside the
    compiled blocks and broke their graphs (12 breaks, 11 graphs against 0 and 3); and an
    eager replay of Inductor's kernels is not what ran. Now: Dynamo's counters as without
    the spike replay, the losses the same, and a gated step `not_compared` with its reason."""
    results = {}
    for armed in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Net()
        compile_blocks(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        settings = dict(port=0, summary_at_exit=False, sample_every=4, min_sample_interval_s=0.0)
        if armed:
            settings.update(spike_replay=True)
        losses = []
        with hookprof.attach(model, **settings) as prof:
            for step in range(1, 91):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
                if step == 80:
                    x = x * 50  # (a spike the data made)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                prof.step(loss)
                losses.append(loss.item())
                with torch.no_grad():  # an evaluation forward between steps
                    model(x)
            prof.flush()
            snap = prof.snapshot()
        breaks = sum(counters["graph_break"].values())
        results[armed] = (losses, breaks, counters["stats"]["unique_graphs"], snap)
    (bare_losses, bare_breaks, bare_graphs, _), (losses, breaks, graphs, snap) = (
        results[False],
        results[True],
    )
    assert losses == bare_losses
    assert (breaks, graphs) == (bare_breaks, bare_graphs)
    assert snap.spike_replays["not_compared"] >= 1
    assert snap.spike_replays["reproduced"] == snap.spike_replays["not_reproduced"] == 0
    assert snap.internal_errors == 0
