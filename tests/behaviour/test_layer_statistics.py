"""A per-layer statistic written as one part (hookprof/step/statistics.py): given to attach(),
exported as hookprof_layer_<name> with the value of each layer's last call on the last
sampled step, never switching anything else off when it fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import hookprof
from hookprof.errors import ConfigError
from support.paths import ROOT, TESTS, worker
from support.ports import free_port
from support.recorded_outputs import profiled_run, train_recording_calls

EVERY_STEP = dict(
    port=0,
    sample_every=1,
    min_sample_interval_s=0.0,
    activation_interval_s=0.0,
    summary_at_exit=False,
)


class OutputMean:
    name = "activation_mean"
    help = "Mean of the layer's output at the last sampled step"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        return output.float().mean()


class OutputL2:
    name = "activation_l2_norm"
    help = "L2 norm of the layer's output at the last sampled step"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(output.float())


class Failing:
    name = "always_fails"
    help = "A statistic whose reduce raises"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this statistic is broken")


class NotAScalar:
    name = "not_a_scalar"
    help = "A statistic that returns a vector"

    def reduce(self, output: torch.Tensor) -> torch.Tensor:
        return output.flatten()[:3]


class WeightRMS:
    """The docs' recipe for a statistic of a layer's parameters (step/statistics.py)."""

    name = "weight_rms"
    help = "Root mean square of the layer's parameters after the last sampled update"
    source = "parameters"

    def reduce(self, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
        squares = sum(p.float().pow(2).sum() for p in parameters)
        return (squares / sum(p.numel() for p in parameters)).sqrt()


class FailsOnBias:
    """A parameter statistic that fails on layers with a bias (every layer of net())."""

    name = "fails_on_bias"
    help = "A parameter statistic whose reduce raises for some layers"
    source = "parameters"

    def reduce(self, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(parameters) > 1:
            raise RuntimeError("no biases here")
        return parameters[0].float().abs().max()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def train_recording(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    """Train; return each layer's output of the last step, read by hooks of the test's own."""
    return {name: outs[-1] for name, outs in train_recording_calls(model, steps, seed=1).items()}


def scraped(url: str, metric: str) -> dict[str, float]:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for fam in text_string_to_metric_families(page):
        if fam.name == metric:
            for sample in fam.samples:
                values[sample.labels["layer"]] = sample.value
    return values, page


def promtool_clean(page: str) -> None:
    if shutil.which("promtool"):
        lint = subprocess.run(
            ["promtool", "check", "metrics"], input=page, text=True, capture_output=True, timeout=60
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_statistic_part_is_exported_per_layer_with_the_last_steps_values():
    model = net()
    prof = hookprof.attach(model, layer_statistics=(OutputMean(), OutputL2()), **EVERY_STEP)
    try:
        outputs = train_recording(model, 4)
        prof.flush()
        means, page = scraped(prof.url, "hookprof_layer_activation_mean")
        norms, _ = scraped(prof.url, "hookprof_layer_activation_l2_norm")
    finally:
        prof.detach()
    assert set(means) == set(norms) == set(outputs) == {"0", "1", "2", "3"}
    for layer, out in outputs.items():
        assert means[layer] == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-7)
        assert norms[layer] == pytest.approx(torch.linalg.vector_norm(out).item(), rel=1e-5)
    assert "# HELP hookprof_layer_activation_mean Mean of the layer's output" in page
    promtool_clean(page)


def test_a_failing_statistic_is_counted_and_switches_nothing_else_off():
    calls, snap, _ = profiled_run(
        net(), 3, 1, layer_statistics=(Failing(), NotAScalar(), OutputMean()), **EVERY_STEP
    )
    outputs = {name: outs[-1] for name, outs in calls.items()}
    assert snap.step == 3 and snap.sampled_steps == 3
    # 2 broken statistics x 4 layer calls x 3 steps, each counted
    assert snap.internal_errors == 2 * 4 * 3
    # (after hookprof's own, registered the same way: step/builtin_statistics.py)
    assert list(snap.layer_statistics) == [
        "activation_abs_max",
        "activation_zero_ratio",
        "weight_norm",
        "update_norm",
        "update_ratio",
        "always_fails",
        "not_a_scalar",
        "activation_mean",
    ]
    assert dict(snap.layer_statistics["always_fails"].values) == {}
    means = snap.layer_statistics["activation_mean"].values
    assert means["3"] == pytest.approx(outputs["3"].mean().item(), rel=1e-5)
    # the per-layer instrumentation stayed on: times and activation maxima of the last step
    assert all(snap.layers[name].activation_abs_max is not None for name in outputs)
    assert snap.layers["3"].activation_abs_max == pytest.approx(outputs["3"].abs().max().item())


def test_a_parameter_statistic_is_one_part_exported_per_layer_after_the_update():
    """docs/architecture.md's recipe, tried: a statistic of each layer's own parameters,
    given to attach() beside an output one, scraped from /metrics and compared with the
    parameters as the test reads them after the last (sampled) update. Layers without
    parameters (the ReLU) get none; a failing parameter statistic is counted, has no gauge,
    and leaves the rest on."""
    model = net()
    prof = hookprof.attach(
        model, layer_statistics=(WeightRMS(), OutputMean(), FailsOnBias()), **EVERY_STEP
    )
    try:
        outputs = train_recording(model, 4)
        prof.flush()
        rms, page = scraped(prof.url, "hookprof_layer_weight_rms")
        means, _ = scraped(prof.url, "hookprof_layer_activation_mean")
        snap = prof.snapshot()
    finally:
        prof.detach()
    expected = {}
    for name, module in model.named_children():
        params = list(module.parameters())
        if params:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            expected[name] = flat.pow(2).mean().sqrt().item()
    assert set(rms) == set(expected) == {"0", "1", "3"}
    for layer, value in expected.items():
        assert rms[layer] == pytest.approx(value, rel=1e-5)
    assert set(means) == set(outputs)  # the output statistic beside it, as before
    assert "# HELP hookprof_layer_weight_rms Root mean square of the layer's parameters" in page
    assert not any(line.startswith("hookprof_layer_fails_on_bias{") for line in page.splitlines())
    assert dict(snap.layer_statistics["fails_on_bias"].values) == {}
    assert snap.internal_errors == 4  # once per sampled step: skipped for the rest of it
    promtool_clean(page)


class BreaksLater:
    """A parameter statistic that works, then fails on every layer (from `broken` on)."""

    name = "breaks_later"
    help = "A parameter statistic that stops working"
    source = "parameters"
    broken = False

    def reduce(self, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.broken:
            raise RuntimeError("broken from now on")
        return parameters[0].float().abs().max()


def test_a_parameter_statistic_that_fails_keeps_no_earlier_value():
    """Review of issue 40's parameter statistics: a step on which the statistic failed on
    every layer sent none of its values, and the rows kept the earlier step's: a gauge of
    weights that had moved on since. Now it has no value, so no gauge."""
    model = net()
    stat = BreaksLater()
    prof = hookprof.attach(model, layer_statistics=(stat,), **EVERY_STEP)
    try:
        train_recording(model, 2)
        prof.flush()
        assert set(prof.snapshot().layer_statistics["breaks_later"].values) == {"0", "1", "3"}
        stat.broken = True
        train_recording(model, 2)
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert dict(snap.layer_statistics["breaks_later"].values) == {}
    assert snap.internal_errors == 2 and snap.sampled_steps == 4


def test_statistics_of_fsdp2_parameters_read_the_ranks_shards():
    """Review of issue 40's parameter statistics: on FSDP2's DTensor parameters the docs'
    recipe returned a DTensor, which the step's one copy could not take; the whole sampled
    packet (layer times, gradient norms, NaN counters) was lost on every sampled step. Now a
    parameter statistic reads each parameter's local shard, and a statistic that returns a
    DTensor anyway is reported and skipped alone. (A process of its own: one rank of a gloo
    group.)"""
    done = subprocess.run(
        [sys.executable, worker("dtensor_statistics_worker.py"), str(free_port())],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["param_type"] == "DTensor"
    assert got["sampled_steps"] == 3 and got["grad_norms"] == ["0", "2"]
    assert set(got["weight_rms"]) == set(got["expected"]) == {"0", "2"}
    for layer, value in got["expected"].items():
        assert got["weight_rms"][layer] == pytest.approx(value, rel=1e-6)
    # the DTensor-returning statistic: 3 layer outputs x 3 steps reported, no value
    assert got["returns_dtensor"] == {} and got["errors"] == 9


@pytest.mark.parametrize(
    "statistics, wrong",
    [
        ([OutputMean()], None),  # a list is taken as a tuple
        (OutputMean(), "a tuple of layer statistics"),
        ((OutputMean(), OutputMean()), "neither given twice"),
        ((type("Own", (OutputMean,), {"name": "activation_abs_max"})(),), "one of hookprof's own"),
        ((type("Bad", (OutputMean,), {"name": "Mean-Value"})(),), "lowercase letters"),
        ((type("NoHelp", (OutputMean,), {"help": " "})(),), "a help text"),
        ((object(),), "objects with name, help and reduce"),
        ((type("Where", (OutputMean,), {"source": "gradients"})(),), "a source of"),
        # a statistic of the check's extremes folds them: no fold, nothing to export
        ((type("NoFold", (OutputMean,), {"source": "extremes"})(),), "of source 'extremes'"),
        ((type("FoldValue", (OutputMean,), {"fold": 3.0})(),), "fold as a method"),
    ],
)
def test_statistics_are_checked_at_attach(statistics, wrong):
    model = net()
    if wrong is None:
        hookprof.attach(model, layer_statistics=statistics, **EVERY_STEP).detach()
        return
    with pytest.raises(ConfigError, match=wrong) as raised:
        hookprof.attach(model, layer_statistics=statistics, **EVERY_STEP)
    assert raised.value.field == "layer_statistics"
    assert not any(module._forward_hooks for module in model.modules())  # nothing left on it
