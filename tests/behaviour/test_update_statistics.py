"""Statistics of source "update" (hookprof/step/update_statistics.py): every layer's
parameters around a measured update, read in one pass over all layers. hookprof's own weight
norm, update norm and update ratio are such statistics, registered like a user's (issue 40);
a user's reads the same sums and costs no device op more."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hookprof
from hookprof import ConfigError
from hookprof.step import builtin_statistics
from hookprof.step.statistics import UPDATE, source_of
from hookprof.step.update_statistics import LayerSums
from support.metrics import parse, samples, scrape
from support.settings import EVERY_STEP

# every sampled step measures every layer's update (no interval, no byte cap)
MEASURE_ALL = dict(
    EVERY_STEP, update_norm_interval_s=0.0, update_norm_max_bytes=1 << 30, summary_at_exit=False
)


class UpdateToWeightDb:
    """A user's statistic of the update: 10 log10(update² / weight²) per layer."""

    name = "update_to_weight_db"
    help = "Update over weight of the layer, in decibels, at its last measured update"
    source = "update"

    def reduce_layers(self, view):  # noqa: ANN001, ANN201
        return view.update_squares(), view.weight_squares()

    def fold(self, calls: list[tuple[float, ...]]) -> float | None:
        update, weight = calls[-1]
        return 10 * math.log10(update / weight) if update > 0 and weight > 0 else None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def train(model: nn.Module, steps: int, prof=None) -> dict[str, tuple[float, float]]:  # noqa: ANN001
    """`steps` Adam steps; returns each parametered child's (update², weight²) of the last
    step, from copies of the test's own."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(3)
    last: dict[str, tuple[float, float]] = {}
    for _ in range(steps):
        before = {
            n: [p.detach().clone() for p in m.parameters()] for n, m in model.named_children()
        }
        loss = model(torch.randn(16, 6, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if prof is not None:
            prof.step(loss)
        last = {
            n: (
                sum(
                    float((p.detach() - b).double().square().sum())
                    for p, b in zip(m.parameters(), before[n])
                ),
                sum(float(p.detach().double().square().sum()) for p in m.parameters()),
            )
            for n, m in model.named_children()
            if before[n]
        }
    return last


def per_layer(page: str, metric: str) -> dict[str, float]:
    return {dict(k)["layer"]: v for k, v in samples(parse(page), metric).items()}


def test_a_users_statistic_of_the_update_is_taken_from_the_same_sums_and_scraped():
    torch.manual_seed(0)
    model = Net()
    prof = hookprof.attach(model, layer_statistics=(UpdateToWeightDb(),), **MEASURE_ALL)
    try:
        expected = train(model, 4, prof)
        prof.flush()
        snap, page = prof.snapshot(), scrape(prof.url)
    finally:
        prof.detach()
    assert set(expected) == {"inp", "out"}  # (ReLU owns no parameters: no value)
    got = per_layer(page, "hookprof_layer_update_to_weight_db")
    assert set(got) == {"inp", "out"}
    for layer, (update, weight) in expected.items():
        assert got[layer] == pytest.approx(10 * math.log10(update / weight), abs=1e-4)
        # the built-ins, from the same measurement, on the page and in the snapshot alike
        assert per_layer(page, "hookprof_layer_weight_norm")[layer] == pytest.approx(
            math.sqrt(weight), rel=1e-6
        )
        assert per_layer(page, "hookprof_layer_update_norm")[layer] == pytest.approx(
            math.sqrt(update), rel=1e-5
        )
        ratio = per_layer(page, "hookprof_layer_update_ratio")[layer]
        assert ratio == pytest.approx(math.sqrt(update / weight), rel=1e-5)
        assert snap.layer_statistics["update_ratio"].values[layer] == ratio
        assert snap.efficiency.layers[layer].update_ratio == ratio  # (for the readers)
    # the model's ratio, from the layers' (update², weight²)
    assert snap.efficiency.update_ratio == pytest.approx(
        math.sqrt(sum(u for u, _ in expected.values()) / sum(w for _, w in expected.values())),
        rel=1e-5,
    )


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of_a_measured_step(statistics: tuple) -> Counter[str]:
    torch.manual_seed(0)
    model = Net()
    prof = hookprof.attach(model, layer_statistics=statistics, **MEASURE_ALL)
    try:
        train(model, 2, prof)  # (step 1 plans, step 2 caches)
        with OpCount() as counted:
            train(model, 1, prof)
        prof.flush()
        assert prof.snapshot().layer_statistics["weight_norm"].values  # (it was measured)
    finally:
        prof.detach()
    return counted.ops


def test_a_statistic_of_the_update_costs_no_device_op_of_its_own():
    """Its reduce_layers returns sums the measurement makes once for all: the step issues
    the same ops with it as without it."""
    assert ops_of_a_measured_step((UpdateToWeightDb(),)) == ops_of_a_measured_step(())


class Broken:
    name, help, source = "broken_update", "Raises", "update"

    def reduce_layers(self, view):  # noqa: ANN001, ANN201
        raise RuntimeError("a bug of the user's")


class WrongType:
    name, help, source = "wrong_update", "Returns a tensor", "update"

    def reduce_layers(self, view):  # noqa: ANN001, ANN201
        return torch.ones(3)


class UnsendableParts:
    """LayerSums of its own making, with parts the step's copy cannot carry (complex)."""

    name, help, source = "unsendable_update", "Complex parts", "update"

    def reduce_layers(self, view):  # noqa: ANN001, ANN201
        weights = view.weight_squares()
        return LayerSums(tuple(p.to(torch.complex64) for p in weights.parts), weights.layers)


def test_a_statistic_of_the_update_that_fails_costs_itself_alone():
    torch.manual_seed(0)
    model = Net()
    prof = hookprof.attach(
        model,
        layer_statistics=(Broken(), WrongType(), UnsendableParts(), UpdateToWeightDb()),
        **MEASURE_ALL,
    )
    try:
        train(model, 3, prof)
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert snap.internal_errors == 3 * 3  # each of the three, each step; nothing switched off
    for failing in ("broken_update", "wrong_update", "unsendable_update"):
        assert dict(snap.layer_statistics[failing].values) == {}
    assert set(snap.layer_statistics["update_to_weight_db"].values) == {"inp", "out"}
    assert set(snap.layer_statistics["update_norm"].values) == {"inp", "out"}
    assert snap.sampled_steps == 3


def test_a_statistic_of_the_update_needs_the_measurement_and_reduce_layers():
    with pytest.raises(ConfigError, match="update_norms=True"):
        hookprof.attach(Net(), layer_statistics=(UpdateToWeightDb(),), update_norms=False, port=0)

    class NoReduceLayers:
        name, help, source = "no_reduce_layers", "Has reduce only", "update"

        def reduce(self, output):  # noqa: ANN001, ANN201
            return output.sum()

    with pytest.raises(ConfigError, match="reduce_layers"):
        hookprof.attach(Net(), layer_statistics=(NoReduceLayers(),), port=0)


def test_the_weight_and_update_norms_are_built_in_statistics():
    """Registered like a user's: classes of BUILT_IN, source "update", their names their
    metrics'; without the update measurement (update_norms=False) not registered at all."""
    update_ones = [s for s in builtin_statistics.BUILT_IN if source_of(s) == UPDATE]
    assert [s.name for s in update_ones] == ["weight_norm", "update_norm", "update_ratio"]
    model = Net()
    prof = hookprof.attach(model, update_norms=False, **{**MEASURE_ALL, "flop_counting": False})
    try:
        train(model, 2, prof)
        prof.flush()
        snap = prof.snapshot()
        page = scrape(prof.url)
    finally:
        prof.detach()
    assert "weight_norm" not in snap.layer_statistics
    assert "hookprof_layer_weight_norm" not in page


def test_a_fault_before_the_update_statistics_frees_the_copies_all_the_same(monkeypatch):
    """The copies taken before the update are freed at the start of the step's packing: a
    fault later in it (here the step series' take, once) loses that step's figures, and the
    next step's update norm is that step's own, not the two steps' together."""
    from hookprof.step.series import StepSeries

    real_take, calls = StepSeries.take, []

    def take_failing_once(self, step):  # noqa: ANN001, ANN202
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("a fault in hookprof's own part")
        return real_take(self, step)

    monkeypatch.setattr(StepSeries, "take", take_failing_once)
    torch.manual_seed(0)
    model = Net()
    prof = hookprof.attach(model, **MEASURE_ALL)
    try:
        expected = train(model, 3, prof)  # (the fault at step 2; step 3's update measured)
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert snap.internal_errors >= 1 and len(calls) >= 3
    for layer, (update, _) in expected.items():
        assert snap.layer_statistics["update_norm"].values[layer] == pytest.approx(
            math.sqrt(update), rel=1e-5
        )
