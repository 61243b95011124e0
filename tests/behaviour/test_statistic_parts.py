"""The per-layer statistics interface (hookprof/step/statistics.py) is the one hookprof's own
statistics use (step/builtin_statistics.py): several values per call folded on the host, a
statistic that reduces only some layers, one of the non-finite check's extremes (no second
pass), and a new built-in added as one class and its metric name (issue 40)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hookprof
from hookprof import metrics_names as names
from hookprof.step import builtin_statistics
from hookprof.step.statistics import values_of
from support.metrics import parse, samples, scrape
from support.recorded_outputs import profiled_run
from support.recorded_outputs import train_recording_calls as recorded
from support.settings import every_step

EVERY_STEP = every_step(summary_at_exit=False)  # (activation statistics every step too)


def per_layer(page: str, metric: str) -> dict[str, float]:
    """layer -> value of one per-layer gauge of a scraped page (rank 0)."""
    return {dict(k)["layer"]: v for k, v in samples(parse(page), metric).items()}


class SharedBlock(nn.Module):
    """`block` and `act` are called twice per forward: a layer's value folds two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(6, 6)
        self.act = nn.ReLU()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.block(x))
        x = self.act(self.block(x))
        return self.head(x)


class MeanOverCalls:
    """The mean of every value the layer output in the step: (sum, count) per call, summed."""

    name = "activation_step_mean"
    help = "Mean of all the layer's outputs in the last sampled step"

    def reduce(self, output: torch.Tensor) -> tuple[torch.Tensor, int]:
        return output.float().sum(), output.numel()

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        return sum(total for total, _ in calls) / sum(count for _, count in calls)


class LinearPeakToPeak:
    """max - min of a Linear's last output in the step, from the non-finite check's own
    extremes (no reduce: nothing done on the device or in the hooks); other layers: none."""

    name = "linear_peak_to_peak"
    help = "max - min of a Linear layer's last output in the last sampled step"
    source = "extremes"

    def applies_to(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        low, high = calls[-1]
        return high - low


class FoldFails:
    name = "fold_fails"
    help = "A statistic whose fold raises"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        return output.float().mean()

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        raise ValueError("a broken fold")


def train_recording_calls(model: nn.Module, steps: int) -> dict[str, list[torch.Tensor]]:
    return recorded(model, steps, seed=2)


def test_values_of_several_calls_are_folded_by_the_statistic():
    torch.manual_seed(0)
    calls, snap, page = profiled_run(
        SharedBlock(), 3, 2, layer_statistics=(MeanOverCalls(), LinearPeakToPeak()), **EVERY_STEP
    )
    means = per_layer(page, "hookprof_layer_activation_step_mean")
    spreads = per_layer(page, "hookprof_layer_linear_peak_to_peak")
    zeros = per_layer(page, "hookprof_layer_activation_zero_ratio")
    assert [len(calls[n]) for n in ("block", "act", "head")] == [2, 2, 1]
    for name, outputs in calls.items():  # every value of both calls, not the last call's
        expected = torch.cat([o.reshape(-1) for o in outputs]).mean().item()
        assert means[name] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # applies_to: the Linears only; the default fold: the last call's value
    assert set(spreads) == {"block", "head"}
    last = calls["block"][-1]
    assert spreads["block"] == pytest.approx((last.max() - last.min()).item(), rel=1e-6)
    # hookprof's own zero ratio is such a part too: both calls of the parameter-free ReLU
    assert set(zeros) == {"act"}
    both = torch.cat([o.reshape(-1) for o in calls["act"]])
    assert zeros["act"] == pytest.approx((both == 0).float().mean().item())
    abs_max = max(o.abs().max().item() for o in calls["block"])
    assert snap.layers["block"].activation_abs_max == pytest.approx(abs_max)
    assert snap.internal_errors == 0
    assert "# HELP hookprof_layer_activation_step_mean Mean of all the layer's outputs" in page


class AtenCount(TorchDispatchMode):
    def __init__(self, op: object) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def aminmax_in_a_sampled_step(statistics: tuple) -> int:
    torch.manual_seed(0)
    model = SharedBlock()
    prof = hookprof.attach(model, layer_statistics=statistics, **EVERY_STEP)
    try:
        train_recording_calls(model, 1)  # (step 1 installs the hooks)
        counter = AtenCount(torch.ops.aten.aminmax.default)
        with counter:
            train_recording_calls(model, 1)
    finally:
        prof.detach()
    return counter.count


def test_a_statistic_of_extremes_takes_no_second_pass():
    """A statistic of source "extremes" adds no aminmax: it folds the check's own."""
    without = aminmax_in_a_sampled_step(())
    assert without >= 5  # (each of the five calls' output checked)
    assert aminmax_in_a_sampled_step((LinearPeakToPeak(),)) == without


def test_a_fold_that_raises_is_counted_and_loses_that_value_alone():
    torch.manual_seed(0)
    calls, snap, _ = profiled_run(
        SharedBlock(), 2, 2, layer_statistics=(FoldFails(), MeanOverCalls()), **EVERY_STEP
    )
    # 3 layers x 2 steps, on the publisher's thread; nothing switched off
    assert snap.internal_errors == 3 * 2
    assert dict(snap.layer_statistics["fold_fails"].values) == {}
    expected = torch.cat([o.reshape(-1) for o in calls["head"]]).mean().item()
    assert snap.layer_statistics["activation_step_mean"].values["head"] == pytest.approx(
        expected, rel=1e-5, abs=1e-7
    )
    assert snap.layers["head"].forward_calls_total == 2


class ActivationRMS:
    """A new built-in, as docs/architecture.md's recipe adds one: this class, its metric."""

    name = "activation_rms"
    help = "Root mean square of the layer's output at the last sampled step"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        return output.float().pow(2).mean().sqrt()


def test_a_new_built_in_statistic_is_one_class_and_its_metric(monkeypatch):
    metric = names.Metric("hookprof_layer_activation_rms", "gauge", ("rank", "layer"), "RMS")
    monkeypatch.setitem(names.BY_NAME, metric.name, metric)
    monkeypatch.setattr(
        builtin_statistics, "BUILT_IN", (*builtin_statistics.BUILT_IN, ActivationRMS())
    )
    torch.manual_seed(0)
    model = SharedBlock()
    prof = hookprof.attach(model, **EVERY_STEP)
    try:
        calls = train_recording_calls(model, 2)
        prof.flush()
        page = scrape(prof.url)
    finally:
        prof.detach()
    rms = per_layer(page, metric.name)
    assert set(rms) == {"block", "act", "head"}
    for name, outputs in calls.items():
        assert rms[name] == pytest.approx(outputs[-1].pow(2).mean().sqrt().item(), rel=1e-5)
    assert f"# HELP {metric.name} RMS" in page  # the metric's, from metrics_names
    # a user's statistic may not take a built-in's name
    with pytest.raises(hookprof.ConfigError, match="hookprof's own metrics"):
        hookprof.attach(SharedBlock(), layer_statistics=(ActivationRMS(),), **EVERY_STEP)


def test_values_of_takes_tensors_and_numbers_and_refuses_the_rest():
    stat = MeanOverCalls()
    value, count = values_of(stat, (torch.tensor([2.5], requires_grad=True), 4))
    assert value.dim() == 0 and not value.requires_grad and count == 4
    for wrong, said in (
        ((torch.ones(2),), "one-value real tensors"),
        ((torch.ones(()), torch.ones((), device="meta")), "several devices"),
        (("1.0",), "tensors or numbers"),
        ((), "no value"),
        ((torch.ones((), dtype=torch.complex64),), "one-value real tensors"),
    ):
        with pytest.raises(TypeError, match=said):
            values_of(stat, wrong)
    abs_max = builtin_statistics.ActivationAbsMax()
    assert abs_max.fold([(-3.0, 2.0), (-1.0, 1.0)]) == 3.0
    assert math.isnan(abs_max.fold([(-1.0, math.nan), (0.0, 5.0)]))  # NaN wins, as in amax


class AllPositive(nn.Module):
    """A bfloat16 ReLU whose 4095 outputs are all above 0, but the first `dead` of them."""

    def __init__(self, dead: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4095)
        self.act = nn.ReLU()
        self.dead = dead

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = self.lin(x).abs() + 1
        shifted = torch.cat([-shifted[:, : self.dead], shifted[:, self.dead :]], dim=1)
        return self.act(shifted)


@pytest.mark.parametrize("dead", [0, 1000])
def test_the_zero_ratio_of_a_bfloat16_model_is_exact(dead):
    """Counts ride the copy beside bfloat16 values; a stack that promoted them to bfloat16
    rounded 4095 to 4096 (a ratio of -0.00024 for no zero at all)."""
    torch.manual_seed(0)
    model = AllPositive(dead).to(torch.bfloat16)
    prof = hookprof.attach(model, **EVERY_STEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        for _ in range(2):
            out = model(torch.randn(1, 8, dtype=torch.bfloat16))
            opt.zero_grad()
            out.float().mean().backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert int((out == 0).sum()) == dead  # (the test's own count)
    assert snap.layers["act"].activation_zero_ratio == dead / 4095
    assert snap.layers["act"].activation_abs_max == out.abs().max().item()


class Unsendable:
    """One-value results a float64 stack cannot take, or a float cannot hold."""

    help = "a statistic with an unusual result"

    def __init__(self, name: str, result) -> None:  # noqa: ANN001
        self.name, self._result = name, result

    def reduce(self, output: torch.Tensor):  # noqa: ANN201
        return self._result(output)


def test_a_result_the_copy_cannot_carry_costs_that_statistic_alone():
    """Refused where the statistic's reduce is contained (counted, no gauge): before, a
    float8 value or an int beyond a float reached the step's stacking and lost its copy."""
    odd = (
        Unsendable("float8_value", lambda out: out.float().mean().to(torch.float8_e4m3fn)),
        Unsendable("huge_number", lambda out: (out.float().mean(), 10**400)),
        Unsendable("on_meta", lambda out: torch.ones((), device="meta")),
    )
    torch.manual_seed(0)
    calls, snap, _ = profiled_run(
        SharedBlock(), 3, 2, layer_statistics=(*odd, MeanOverCalls()), **EVERY_STEP
    )
    assert snap.sampled_steps == 3
    assert snap.internal_errors == 3 * 5 * 3  # 3 statistics x 5 calls x 3 steps
    for stat in odd:
        assert dict(snap.layer_statistics[stat.name].values) == {}
    expected = torch.cat([o.reshape(-1) for o in calls["act"]]).mean().item()
    assert snap.layer_statistics["activation_step_mean"].values["act"] == pytest.approx(
        expected, rel=1e-5, abs=1e-7
    )
    assert snap.layers["head"].grad_norm is not None  # (the step's other figures arrived)


class CallNumber:
    """The call's number within the step: a host number on odd calls, a tensor on even ones
    (stacked apart from the host numbers, then given back in call order)."""

    name = "call_number"
    help = "The number of the layer's last call within the step"

    def __init__(self) -> None:
        self.calls = 0
        self.folded: list[list[float]] = []

    def reduce(self, output: torch.Tensor):  # noqa: ANN201
        self.calls += 1
        return float(self.calls) if self.calls % 2 else torch.tensor(float(self.calls))

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        self.folded.append([values[0] for values in calls])
        return calls[-1][0]


def test_fold_gets_the_calls_in_call_order():
    torch.manual_seed(0)
    stat = CallNumber()
    model = nn.Sequential(nn.Linear(6, 6))
    model.forward = lambda x: model[0](model[0](x))  # (one layer called twice a step)
    prof = hookprof.attach(model, layer_statistics=(stat,), **EVERY_STEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        for _ in range(2):
            stat.calls = 0
            opt.zero_grad()
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert stat.folded[-1] == [1.0, 2.0]
    assert dict(snap.layer_statistics["call_number"].values) == {"0": 2.0}


class OwnsParameters(nn.Module):
    """Every layer owns parameters: hookprof's zero ratio reduces none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class FailsWhenTold:
    name = "activation_mean"
    help = "Mean of the layer's output"

    def __init__(self) -> None:
        self.fail = False

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("fails this step")
        return output.float().mean()


def test_a_statistic_that_gave_nothing_on_a_checked_step_keeps_no_earlier_value():
    """Its rows are replaced on every step with activation statistics, even when no statistic
    of outputs gave a value (they were kept before when nothing reached the copy)."""
    torch.manual_seed(0)
    model, stat = OwnsParameters(), FailsWhenTold()
    prof = hookprof.attach(model, layer_statistics=(stat,), **EVERY_STEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    values = []
    try:
        for step in range(3):
            stat.fail = step == 2
            opt.zero_grad()
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            prof.flush()
            values.append(dict(prof.snapshot().layer_statistics["activation_mean"].values))
    finally:
        prof.detach()
    assert set(values[1]) == {"(root)", "lin"}
    assert values[2] == {}


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on another device (what pack_step groups by)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device):  # noqa: ANN204
        made = torch.Tensor._make_subclass(cls, data)
        made._said = device
        return made

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._said

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class LastMax:
    name = "last_max"
    help = "max of the layer's last output in the step"
    source = "extremes"

    def fold(self, calls: list[tuple[float, ...]]) -> float:
        return calls[-1][1]


def test_statistics_of_extremes_get_the_calls_in_call_order_across_devices(monkeypatch):
    """A pipeline over two devices calls one ReLU on the first, the second, then the first
    again: the copy groups the checks by device, and the fold still sees the calls in
    order (it saw the second call last before)."""
    first, second = torch.device("cpu", 1), torch.device("cpu", 2)
    now = [first]
    aminmax = torch.aminmax

    def on_device(t: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        low, high = aminmax(t, *args, **kwargs)
        return OnDevice(low, now[0]), OnDevice(high, now[0])

    class Pipeline(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin0, self.lin1, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for device, layer in ((first, self.lin0), (second, self.lin1), (first, self.head)):
                now[0] = device
                x = self.act(layer(x))
            return x

    torch.manual_seed(0)
    model = Pipeline()
    outputs: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    monkeypatch.setattr(torch, "aminmax", on_device)
    prof = hookprof.attach(model, layer_statistics=(LastMax(),), **EVERY_STEP)
    try:
        (model(torch.randn(8, 6) * 3).pow(2).mean()).backward()
        prof.step()
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert len(outputs) == 3
    assert snap.layer_statistics["last_max"].values["act"] == outputs[-1].max().item()
    assert snap.layers["act"].activation_abs_max == max(o.abs().max().item() for o in outputs)
    assert snap.internal_errors == 0
