"""Training loops as users write them (issue 11): BatchNorm and buffers under the forward
replay, models called several times per step, GradScaler skips that really happened, outputs
with several tensors, modules called twice. Each test reproduced a defect before its fix."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

import hookprof
from support.hooks_left import post_accumulate_grad_hooks
from support.inject import NanAt
from support.settings import RARELY


def nan_rows(x: torch.Tensor, at: bool) -> torch.Tensor:
    if at:
        x = x.clone()
        x[0, 0] = float("nan")
    return x


class Scaled(nn.Module):
    """A layer that multiplies by a buffer (saved for backward, like BatchNorm's statistics)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, x):
        return x * self.scale


def bn_model(poison: NanAt | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), Scaled(16), nn.ReLU()]
    if poison is not None:
        layers.append(poison)
    return nn.Sequential(*layers, nn.Linear(16, 1))


def train_bn(model: nn.Module, steps: int, prof=None, poison=None, nan_input_at=()):
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        if poison is not None:
            poison.step = step
        x = nan_rows(torch.randn(32, 8, generator=g), step in nan_input_at)
        y = torch.randn(32, 1, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()


def test_forward_replay_leaves_batchnorm_and_buffer_layers_trainable():
    """Case 1: the replay restored buffers with copy_, which bumped the version of tensors
    autograd had saved for the step's backward: loss.backward() raised."""
    reference_poison = NanAt({3})
    reference = bn_model(reference_poison)
    train_bn(reference, 6, poison=reference_poison)

    poison = NanAt({3})
    model = bn_model(poison)
    with hookprof.attach(model, **RARELY) as prof:
        train_bn(model, 6, prof=prof, poison=poison)  # raised at step 3 before the fix
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 6
    assert snap.first_nonfinite.layer == "4" and snap.first_nonfinite.step == 3  # NanAt
    assert snap.first_nonfinite.phase == "forward"
    # the replay changed nothing: running statistics and parameters as without hookprof
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b) or (a.isnan().any() and torch.equal(a.isnan(), b.isnan())), name


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.encoder(x)


@pytest.mark.parametrize("calls", [2, 3])
def test_a_model_called_several_times_per_step_counts_one_step_and_no_skips(calls):
    """Case 2: with zero_grad() before the forwards (siamese, triplet), each extra call ended
    a "step" counted as a GradScaler skip, with no GradScaler anywhere."""
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        for _ in range(30):
            opt.zero_grad()
            outs = [model(torch.randn(16, 8, generator=g)) for _ in range(calls)]
            loss = sum((outs[0] - o).pow(2).mean() for o in outs[1:]) + outs[0].pow(2).mean()
            loss.backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 30
    assert snap.skipped_steps == 0
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
    assert snap.layers["encoder.0"].calls == calls  # every call of the last step recorded


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        h = self.body(x)
        return self.a(h), self.b(h)


def test_a_bad_forward_step_counts_once_whatever_the_number_of_outputs():
    """Case 4: a model returning two tensors counted 2 per bad step."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    with hookprof.attach(model, **RARELY) as prof:
        for step in range(1, 6):
            x = nan_rows(torch.randn(4, 8, generator=g), step == 3)
            opt.zero_grad()
            a, b = model(x)
            (a.mean() + b.mean()).backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    # step 3's NaN poisons every parameter: steps 3, 4 and 5 are bad, once each
    assert snap.nonfinite_steps["forward"] == 3


class Twice(nn.Module):
    def __init__(self, poison: NanAt):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.poison = poison
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        x = self.poison(self.first(x))
        x = self.shared(torch.relu(self.shared(x)))  # the same module called twice
        return self.head(x)


def test_propagators_name_each_module_once():
    """Case 10: NonFiniteEvent.propagators repeated modules called twice."""
    poison = NanAt({2})
    torch.manual_seed(0)
    model = Twice(poison)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    with hookprof.attach(model, **RARELY) as prof:
        for step in range(1, 4):
            poison.step = step
            opt.zero_grad()
            model(torch.randn(4, 4, generator=g)).mean().backward()
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert event.layer == "poison" and event.step == 2
    assert event.propagators == ("shared", "head")


def test_the_last_step_is_published_without_another_step_or_a_flush():
    """Case 5: the last sampled step was withheld from /metrics until the next forward,
    flush() or detach(): a run that stopped or hung stayed one step behind for ever."""
    from support.metrics import parse, samples, scrape

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(5)
    with hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, publish_interval_s=0.2
    ) as prof:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(
                model(torch.randn(8, 8, generator=g)), torch.zeros(8, 1)
            ).backward()
            opt.step()
        ended = time.monotonic()
        rank = frozenset({"rank": "0"}.items())
        while time.monotonic() - ended < 10.0:  # training has stopped: nothing else happens
            f = parse(scrape(prof.url))
            if samples(f, "hookprof_sampled_steps", "hookprof_sampled_steps_total")[rank] == 4:
                break
            time.sleep(0.02)
        assert samples(f, "hookprof_sampled_steps", "hookprof_sampled_steps_total")[rank] == 4
        assert samples(f, "hookprof_steps", "hookprof_steps_total")[rank] == 4
        expected = torch.linalg.vector_norm(
            torch.cat([p.grad.reshape(-1) for p in model[2].parameters()])
        )
        got = samples(f, "hookprof_layer_gradient_norm")[
            frozenset({"rank": "0", "layer": "2"}.items())
        ]
        assert got == pytest.approx(expected.item(), rel=1e-5)  # the last step's own norms


def test_a_loop_without_step_signal_stays_bounded_and_says_what_it_needs(caplog):
    """Case 3: a hand-written update (no torch.optim, no prof.step()) gave 0 steps, no word,
    hooks installed for ever and a step record growing with every call."""
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(6)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
            for _ in range(1200):
                loss = nn.functional.mse_loss(
                    model(torch.randn(4, 8, generator=g)), torch.zeros(4, 1)
                )
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.01 * p.grad
                        p.grad = None
            # per-layer work stopped: no wrapper left on the layers, nothing recorded
            assert all("forward" not in m.__dict__ for m in model)
            assert prof.steps == 0
            prof.step(loss)  # the signal it asked for: from here on steps are counted
            model(torch.randn(4, 8, generator=g)).sum().backward()
            prof.step()
            prof.flush()
            snap = prof.snapshot()
    lines = [r.getMessage() for r in caplog.records if "without a step boundary" in r.getMessage()]
    assert len(lines) == 1 and "prof.step(" in lines[0]
    assert snap.step == 2 and snap.sampled_steps == 1  # step 2 sampled again, normally
    assert snap.layers["0"].calls == 1 and snap.layers["0"].grad_norm is not None
    assert [n for n in snap.notices if "without a step boundary" in n] == [
        lines[0].removeprefix("hookprof: ")
    ]


def test_steps_ended_after_zero_grad_say_why_norms_are_missing(caplog):
    """Case 3: prof.step() after clearing the gradients gave steps without norms or backward
    checks, and nothing said so."""
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(8)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
            for _ in range(3):
                loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.01 * p.grad
                opt.zero_grad()  # cleared before the step ends
                prof.step(loss)
            prof.flush()
            snap = prof.snapshot()
    assert snap.step == 3 and snap.layers["0"].grad_norm is None
    said = [r.getMessage() for r in caplog.records if "had a gradient" in r.getMessage()]
    assert len(said) == 1 and "zero_grad" in said[0]
    assert [n for n in snap.notices if "had a gradient" in n] == [
        said[0].removeprefix("hookprof: ")
    ]


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.stem(x)))


def loop(model, steps, prof, *, nan_input_at=(), poison=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        if poison is not None:
            poison.step = step
        x = nan_rows(torch.randn(4, 8, generator=g), step in nan_input_at)
        opt.zero_grad()
        out = model(x)
        tensors = [out] if isinstance(out, torch.Tensor) else [out.a, out.b]
        sum(t.mean() for t in tensors).backward()
        opt.step()


@pytest.mark.parametrize(
    "settings",
    [RARELY, dict(port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)],
    ids=["replayed", "checked-step"],
)
def test_a_nan_in_the_batch_is_the_inputs(settings):
    """Case 8: a NaN in the input batch was never attributed (layer None for ever)."""
    torch.manual_seed(0)
    model = Embed()
    with hookprof.attach(model, **settings) as prof:
        loop(model, 5, prof, nan_input_at={3})
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert (event.layer, event.phase, event.step) == ("(input)", "forward", 3)
    assert event.propagators == ("stem", "head")


class Attention(nn.Module):
    """Its own code (a softmax written by hand) overflows between its children's calls."""

    def __init__(self, at: set[int]):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(8, 8) for _ in range(4))
        self.at, self.step = at, 0

    def forward(self, x):
        scores = self.q(x) @ self.k(x).T * (1e4 if self.step in self.at else 1.0)
        weights = torch.exp(scores)  # inf at the bad step ...
        weights = weights / weights.sum(dim=-1, keepdim=True)  # ... and inf / inf = NaN
        return self.proj(weights @ self.v(x))


class WithAttention(nn.Module):
    def __init__(self, at: set[int]):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.attn = Attention(at)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)))


def test_a_nan_made_by_a_container_modules_own_code_names_it():
    """Case 8: a NaN made by a non-leaf module's own code (exp of a large attention score,
    then a division) between its children was never attributed."""
    torch.manual_seed(0)
    model = WithAttention({3})
    with hookprof.attach(model, **RARELY) as prof:
        loop(model, 4, prof, poison=model.attn)
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert (event.layer, event.phase, event.step) == ("attn", "forward", 3)
    assert event.last_finite_child == "attn.v"  # the last child that ran finite
    assert event.propagators == ("attn.proj", "head")


@dataclasses.dataclass
class TwoOutputs:
    a: torch.Tensor
    b: torch.Tensor


class DataclassNet(nn.Module):
    def __init__(self, poison: NanAt):
        super().__init__()
        self.a = nn.Linear(8, 1)
        self.poison = poison
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return TwoOutputs(self.poison(self.a(x)), self.b(x))


def test_a_dataclass_output_is_checked_and_its_producer_named():
    """Case 7: a @dataclass output was not checked, and a NaN made in `a` was reported as
    ('b', 'backward')."""
    poison = NanAt({3})
    torch.manual_seed(0)
    model = DataclassNet(poison)
    with hookprof.attach(model, **RARELY) as prof:
        loop(model, 4, prof, poison=poison)
        prof.flush()
        snap = prof.snapshot()
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("poison", "forward", 3)
    assert snap.nonfinite_steps["forward"] >= 1


def test_a_replay_on_a_sampled_step_without_checks_leaves_nothing_after_detach():
    """Review B1: the replay took over the sampled step's record, whose parameter hooks then
    outlived detach() and grew for ever."""
    torch.manual_seed(0)
    model = Embed()
    with hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, activation_stats=False
    ) as prof:  # sampled, never checked: replays
        loop(model, 3, prof, nan_input_at={2})
        prof.flush()
        assert prof.snapshot().first_nonfinite.layer == "(input)"
    assert all(
        not post_accumulate_grad_hooks(p) and not p._backward_hooks for p in model.parameters()
    )


class Masked(nn.Module):
    """An additive attention mask of -inf in the root's inputs, used finitely."""

    def __init__(self, poison: NanAt):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.poison = poison
        self.head = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.head(self.poison(self.inner(x) + mask.clamp(min=0)))


@pytest.mark.parametrize(
    "settings",
    [RARELY, dict(port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)],
    ids=["replayed", "checked-step"],
)
def test_an_inf_mask_among_the_inputs_does_not_take_the_blame(settings):
    """Review B2: any non-finite root input made "(input)" the producer of every NaN."""
    poison = NanAt({3})
    torch.manual_seed(0)
    model = Masked(poison)
    mask = torch.triu(torch.full((4, 8), float("-inf")), diagonal=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(9)
    with hookprof.attach(model, **settings) as prof:
        for step in range(1, 5):
            poison.step = step
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g), mask).mean().backward()
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert (event.layer, event.phase, event.step) == ("poison", "forward", 3)


def test_a_callers_registry_gets_its_collectors_back_at_detach():
    """Review B4: hookprof's collectors stayed in a registry the caller passed in."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    torch.manual_seed(0)
    prof = hookprof.Profiler(Embed(), hookprof.Config(serve=False), registry=registry)
    assert b"hookprof_steps_total" in generate_latest(registry)
    prof.detach()
    assert b"hookprof_" not in generate_latest(registry) and b"process_" not in generate_latest(
        registry
    )


def test_an_lbfgs_step_with_thousands_of_closure_calls_is_one_step(caplog):
    """Review B5: forwards inside one closure step counted toward the "no step signal" limit."""
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.LBFGS(
        model.parameters(),
        lr=1e-4,
        max_iter=1500,
        max_eval=1500,
        tolerance_grad=0.0,
        tolerance_change=0.0,
        history_size=2,
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with caplog.at_level(logging.WARNING, logger="hookprof"):
        with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
            opt.step(closure)
            prof.flush()
            snap = prof.snapshot()
    assert len(calls) > 1000
    assert not [r for r in caplog.records if "without a step boundary" in r.getMessage()]
    assert snap.step == 1 and snap.layers["0"].calls == len(
        calls
    )  # every call of the step recorded
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.reshape(-1) for p in model[0].parameters()])
    )
    assert snap.layers["0"].grad_norm == pytest.approx(expected.item(), rel=1e-5)


def test_the_disabled_profiler_has_the_same_public_surface(monkeypatch):
    """Review B6: DisabledProfiler lacked Profiler.steps."""
    monkeypatch.setenv("HOOKPROF_DISABLE", "1")
    torch.manual_seed(0)
    disabled = hookprof.attach(Embed())
    public = {n for n in dir(hookprof.Profiler) if not n.startswith("_")}
    assert public <= set(dir(disabled)), public - set(dir(disabled))
    assert disabled.steps == 0
