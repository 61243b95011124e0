"""The every-step gradient check at the backward's end (step/backward_end.py, issue 38): what
the loop does between backward() and the update cannot move the first bad layer; a NaN the
loop's own guard drops is still counted; one made after the backward is counted too;
accumulation; a backward that raised; detach; a fault in the check itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.step.backward_end import BackwardEnd
from hookprof.view.table import from_metrics, from_snapshot, nonfinite_line
from support.first_nan import behind_by
from support.metrics import parse, samples, scrape
from support.models import DeepNet
from support.settings import RARELY


class NanGradient(torch.autograd.Function):
    """Identity forward; in backward, the gradient made NaN at `step` (blocks.3's output
    gradient: blocks.3.fc's own gradients are the first that backward computes non-finite)."""

    @staticmethod
    def forward(ctx, x, bad):
        ctx.bad = bad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("nan") if ctx.bad else grad), None


class Poisoned(DeepNet):
    def __init__(self):
        super().__init__()
        self.bad_at: int | None = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.stem(x)
        for k, block in enumerate(self.blocks):
            x = block(x)
            if k == 3:
                x = NanGradient.apply(x, self.calls == self.bad_at)
        return self.head(x)


def model_and_data(bad_at):
    torch.manual_seed(0)
    model = Poisoned()
    model.bad_at = bad_at
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(8)]
    return model, batches


def first(prof):
    prof.flush()
    e = prof.snapshot().first_nonfinite
    return None if e is None else (e.layer, e.phase, e.step)


@pytest.mark.parametrize("lag", [0, 3])
@pytest.mark.parametrize("policy", ["record", "skip"])
def test_a_clip_by_a_nan_norm_does_not_move_the_first_layer(lag, policy):
    """clip_grad_norm_ of a NaN total multiplies every gradient by NaN before the update:
    every layer reads non-finite there, the head last in backward's order... first named
    before the fix. Named blocks.3.fc, whose gradient backward made NaN first."""
    model, batches = model_and_data(bad_at=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=bool(lag))
    with behind_by(lag):
        prof = hookprof.attach(
            model, config=hookprof.Config(summary_at_exit=False, on_nonfinite=policy, **RARELY)
        )
        try:
            for x, y in batches[:5]:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                if model.calls == 3:
                    assert (
                        not torch.isfinite(norm)
                        and not torch.isfinite(model.head.weight.grad).all()
                    )
                opt.step()
            assert first(prof) == ("blocks.3.fc", "backward", 3)
        finally:
            prof.detach()


def own_scaler_drops(model, opt, x, y) -> bool:
    """A loss scaler of the loop's own (not torch's GradScaler: DeepSpeed's, Megatron's, a
    hand-written one): on overflow it zeroes the gradients and skips the update."""
    (nn.functional.mse_loss(model(x), y) * 1024.0).backward()
    if any(not torch.isfinite(p.grad).all() for p in model.parameters()):
        opt.zero_grad()
        return True
    for p in model.parameters():
        p.grad.div_(1024.0)
    opt.step()
    return False


def guard_drops(model, opt, x, y) -> bool:
    """Issue 38's guard: `if not isfinite(clip_grad_norm_(...)): zero_grad(); continue`
    (the clip has already multiplied every gradient by the NaN norm)."""
    nn.functional.mse_loss(model(x), y).backward()
    if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
        opt.zero_grad()
        return True
    opt.step()
    return False


@pytest.mark.parametrize("lag", [0, 3])
@pytest.mark.parametrize("drop", [own_scaler_drops, guard_drops], ids=["own loss scaler", "guard"])
@pytest.mark.parametrize("policy", ["record", "raise"])
def test_gradients_the_loop_drops_are_counted_and_named_and_no_incident(policy, drop, lag):
    """The loop drops step 3's non-finite gradients before any update, as it is meant to:
    no incident, no NonFiniteError into a healthy run (review H1), and still counted and
    named (issue 38, item 4): one dropped step, its first layer the one whose gradient the
    test's own hooks see go non-finite first (blocks.3.fc: backward computes it before the
    layers below)."""
    model, batches = model_and_data(bad_at=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[
        str
    ] = []  # the test's own hooks: parameters whose gradient came non-finite, in order
    handles = [
        p.register_hook(
            lambda g, name=name: seen.append(name) if not torch.isfinite(g).all() else None
        )
        for name, p in model.named_parameters()
    ]
    with behind_by(lag):
        prof = hookprof.attach(
            model, config=hookprof.Config(summary_at_exit=False, on_nonfinite=policy, **RARELY)
        )
        try:
            dropped = 0
            for x, y in batches[:6]:
                opt.zero_grad()
                dropped += drop(model, opt, x, y)
            prof.flush()
            snap = prof.snapshot()
            assert dropped == 1 and seen and seen[0].startswith("blocks.3.fc.")
            assert first(prof) is None and sum(snap.nonfinite_steps.values()) == 0
            got = snap.dropped_nonfinite
            assert got is not None and (got.steps, got.layer) == (1, "blocks.3.fc")
            # the guard's `continue` and the next micro-batch are one step (that update's)
            assert got.first_step == 3
            # every layer at or below the NaN went non-finite; none above it
            below = {n.rsplit(".", 1)[0] for n in seen}
            assert set(got.others) | {got.layer} == below
            text = scrape(prof.url)
            page = parse(text)  # the same, as Prometheus reads it
            assert list(
                samples(
                    page,
                    "hookprof_dropped_nonfinite_steps",
                    "hookprof_dropped_nonfinite_steps_total",
                ).values()
            ) == [1.0]
            info = samples(page, "hookprof_first_dropped_nonfinite_info")
            assert [dict(k) for k in info] == [{"rank": "0", "layer": "blocks.3.fc", "step": "3"}]
            assert not samples(page, "hookprof_first_nonfinite_info")
            # what a person reads: the summary's line, and `hookprof top`'s from the page
            line = nonfinite_line(from_snapshot(snap).header)
            assert line.startswith("non-finite steps: none;") and (
                "dropped the non-finite gradients of 1 step (no incident; first: blocks.3.fc at step 3)"
                in line
            )
            assert nonfinite_line(from_metrics(text)[0].header) == line
        finally:
            prof.detach()
            for h in handles:
                h.remove()


def edit_through_data(model):
    model.blocks[1].fc.weight.grad.data.mul_(float("inf"))  # .data: its own version counter


def edit_in_a_freed_place(model):
    p = model.blocks[1].fc.weight
    g = p.grad.clone()
    p.grad = None
    p.grad = g / 0.0  # a new tensor where a freed one was (its id may be reused)


def edit_in_place(model):
    g = model.blocks[1].fc.bias.grad
    g.div_(g.sub(g).norm())  # x / 0: NaN where x is 0, Inf elsewhere


@pytest.mark.parametrize(
    "edit, step",
    [(edit_through_data, 3), (edit_in_a_freed_place, 3), (edit_in_place, 4)],
    ids=["through .data", "a new tensor in a freed one's place", "in place"],
)
def test_a_nan_made_after_the_backward_is_counted_where_the_update_reads_it(edit, step):
    """Gradients finite as backward left them, made NaN by the loop (a normalisation of a
    zero gradient, an all-reduce that overflows), also by edits the version counters do not
    show (review M2: through `.data`, as apex- and Megatron-era clipping and all-reduce code
    does; a gradient replaced after the old one was freed): the update's reading sees them,
    at their step, and names the layer they are in."""
    model, batches = model_and_data(bad_at=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    try:
        for k, (x, y) in enumerate(batches[:5], start=1):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if k == step:
                edit(model)
            opt.step()
        assert first(prof) == ("blocks.1.fc", "backward", step)
    finally:
        prof.detach()


def test_accumulation_counts_a_nan_of_any_micro_batch():
    """Four micro-batches per update, the second's backward NaN: counted at that update (the
    NaN update then makes the next one's non-finite too: record lets it through)."""
    model, batches = model_and_data(bad_at=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    try:
        for x, y in batches[:8]:
            nn.functional.mse_loss(model(x), y).backward()
            if model.calls % 4 == 0:
                opt.step()
                opt.zero_grad()
        assert first(prof) == ("blocks.3.fc", "backward", 1)
    finally:
        prof.detach()


def test_a_backward_that_raised_leaves_the_next_ones_checked():
    """A backward that raises never runs its queued callback: the next forward starts
    afresh, and a later NaN is still found at the backward's end (not only at the update,
    which the clip here would make every layer's)."""
    model, batches = model_and_data(bad_at=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    boom = {"on": True}

    def raise_once(grad):
        if boom.pop("on", False):
            raise RuntimeError("a user's hook fails")
        return grad

    handle = model.head.weight.register_hook(raise_once)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    try:
        for x, y in batches[:6]:
            opt.zero_grad()
            try:
                nn.functional.mse_loss(model(x), y).backward()
            except RuntimeError:
                continue  # the loop goes on, as a notebook does
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
        layer, phase, _ = first(prof)
        assert (layer, phase) == ("blocks.3.fc", "backward")
        assert prof.snapshot().internal_errors == 0
    finally:
        handle.remove()
        prof.detach()


def test_after_detach_a_graph_built_before_calls_nothing():
    model, batches = model_and_data(bad_at=None)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))
    x, y = batches[0]
    loss = nn.functional.mse_loss(model(x), y)
    prof.detach()
    calls = []
    end = prof._backward_end
    end.on_end = lambda: calls.append(1)  # what would run at the backward's end
    loss.backward()
    assert calls == [] and prof.snapshot().internal_errors == 0


def test_a_fault_in_the_check_is_counted_and_the_update_reads_them_instead(monkeypatch):
    """The check at the backward's end fails (a fault injected into hookprof's own part):
    backward() returns normally, the fault is counted under "nonfinite", and the
    gradients are checked where the update reads them."""
    model, batches = model_and_data(bad_at=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.attach(model, config=hookprof.Config(summary_at_exit=False, **RARELY))

    def broken():
        raise RuntimeError("injected")

    monkeypatch.setattr(prof._backward_end, "on_end", broken)
    try:
        for x, y in batches[:5]:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert first(prof) == ("blocks.3.fc", "backward", 3)
        snap = prof.snapshot()
        assert snap.internal_errors == 5 and prof._faults.by_part["nonfinite"] == 5
    finally:
        prof.detach()


def test_backward_end_runs_once_per_backward_through_several_outputs():
    """An output of several tensors (a dict) whose nodes all run in one backward: one call."""
    ends = []
    end = BackwardEnd(lambda: ends.append(1), faults=None)
    a = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    out = {"y": a(x), "z": a(x) * 2, "w": a(x).sum()}
    end.watch(out)
    (out["y"].sum() + out["z"].sum() + out["w"]).backward()
    assert ends == [1]
    out = {"y": a(x), "z": a(x) * 2}
    end.watch(out)
    out["y"].sum().backward(retain_graph=True)  # two backwards: two ends
    out["z"].sum().backward()
    assert ends == [1, 1, 1]


@pytest.mark.parametrize(
    "attach_first", [False, True], ids=["compiled, then attached", "attached, then compiled"]
)
def test_a_compiled_model_is_checked_at_its_backwards_end_too(attach_first):
    """Compiled, the root's hooks are traced into the graph (no node to hook): the end is
    queued from two parameters' accumulation instead. Without that the clip's NaN names the
    head (checked with those hooks taken out); and detach() takes them out."""
    model, batches = model_and_data(bad_at=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    settings = hookprof.Config(summary_at_exit=False, **RARELY)
    if attach_first:
        prof = hookprof.attach(model, config=settings)
        call = torch.compile(model, backend="aot_eager")
    else:
        call = torch.compile(model, backend="aot_eager")
        prof = hookprof.attach(call, config=settings)
    try:
        for x, y in batches[:5]:
            opt.zero_grad()
            nn.functional.mse_loss(call(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
        assert first(prof) == ("blocks.3.fc", "backward", 3)
    finally:
        prof.detach()
    assert all(
        not p._post_accumulate_grad_hooks
        for p in model.parameters()
        if getattr(p, "_post_accumulate_grad_hooks", None) is not None
    )


def test_training_through_autograd_grad_is_checked_where_the_update_reads_and_timed():
    """Issue 39, item 5: gradients from torch.autograd.grad, put into .grad by hand (meta-
    learning, gradient penalties). autograd.grad writes no .grad, so the backward's end
    must not read .grad (it would hold the last step's: a NaN counted twice, or a stale
    step's layer): the update reads them. And every layer is timed in backward (the first
    layer had 0 backward calls: its end was taken from .grad's accumulation)."""
    model, batches = model_and_data(bad_at=3)
    opt = torch.optim.SGD(
        model.parameters(), lr=0.01, fused=True
    )  # skip holds step 3's update back
    prof = hookprof.attach(
        model,
        config=hookprof.Config(
            summary_at_exit=False,
            port=0,
            sample_every=1,
            min_sample_interval_s=0.0,
            on_nonfinite="skip",
        ),
    )
    try:
        for x, y in batches[:6]:
            loss = nn.functional.mse_loss(model(x), y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g  # the last step's .grad replaced, never zeroed: stale until now
            opt.step()
        prof.flush()
        snap = prof.snapshot()
        assert first(prof) == ("blocks.3.fc", "backward", 3)
        assert snap.nonfinite_steps["backward"] == 1  # not step 4 again, from step 3's stale .grad
        assert (
            snap.layers["stem"].backward_calls_total == 6
            and snap.layers["stem"].backward_seconds_total > 0
        )
        assert all(s.backward_calls_total == 6 for s in snap.layers.values())
    finally:
        prof.detach()
