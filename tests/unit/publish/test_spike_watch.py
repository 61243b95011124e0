"""The spike judge of the every-step series (publish/spikes.py), against a robust z-score
computed here with numpy from the same windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hookprof.publish.spikes import (
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    MIN_HISTORY,
    UPDATE_RATIO_JUMP,
    SpikeWatch,
)
from hookprof.step.series import StepValue

WINDOW = 200


def noisy(n: int, level: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(level + 0.05 * rng.standard_normal(n))


def z_here(value: float, before: list[float]) -> tuple[float, float]:
    window = np.array(before[-WINDOW:])
    median = float(np.median(window))
    scale = float(np.percentile(window, 75) - np.percentile(window, 25)) / 1.349
    return (value - median) / scale, median


def test_spike_events_are_counted_once_each_with_their_first_step_and_z():
    losses = noisy(1000, 2.0, 0)
    for step in (300, 301, 302):  # one event of three steps
        losses[step - 1] = 5.0
    losses[600 - 1] = 4.0  # a second, one step
    norms = noisy(1000, 1.0, 1)
    norms[450 - 1] = 40.0
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0})
    watch.observe(StepValue(s, losses[s - 1], norms[s - 1]) for s in range(1, 1001))
    counts = watch.counts()
    loss = counts[LOSS_SPIKE]
    assert (loss.count, loss.first.step, loss.last.step) == (2, 300, 600)
    z, median = z_here(losses[299], losses[:299])
    assert loss.first.z == pytest.approx(z, rel=1e-9) and loss.first.median == pytest.approx(median)
    assert loss.first.value == 5.0 and z > 8
    norm = counts[GRAD_NORM_SPIKE]
    assert (norm.count, norm.first.step) == (1, 450)


def test_no_judgement_before_the_history_and_none_for_a_falling_or_noisy_run():
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0})
    falling = [10.0 * math.exp(-s / 300) + 0.01 * math.sin(s) for s in range(1, 3001)]
    # a huge value among the first steps, before any baseline: not judged
    falling[MIN_HISTORY // 2] = 1e6
    watch.observe(StepValue(s, falling[s - 1], 1.0 + 0.1 * math.cos(s)) for s in range(1, 3001))
    assert all(c.count == 0 for c in watch.counts().values())


def test_non_finite_values_are_the_nan_checks_and_a_repeated_step_is_not_judged_again():
    losses = noisy(400, 2.0, 2)
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0})
    values = [StepValue(s, losses[s - 1], None) for s in range(1, 301)]
    values[250] = StepValue(251, math.inf, None)
    values[251] = StepValue(252, math.nan, None)
    watch.observe(values)
    watch.observe([StepValue(300, 1e9, None)])  # a late loss of step 300, already judged
    assert watch.counts()[LOSS_SPIKE].count == 0
    watch.observe([StepValue(301, 1e9, None)])
    assert watch.counts()[LOSS_SPIKE].last.step == 301


def test_never_above_an_infinite_threshold():
    """What Config.spike_detection=False gives the judge."""
    losses = noisy(400, 2.0, 3)
    losses[350] = 1e6
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: math.inf, GRAD_NORM_SPIKE: math.inf})
    watch.observe(StepValue(s, losses[s - 1], losses[s - 1]) for s in range(1, 401))
    assert all(c.count == 0 for c in watch.counts().values())


def test_a_loss_given_after_the_step_ended_is_judged_when_its_step_comes_again():
    """Review: a drain repeats the previous drain's last step (step/series.py take), which
    carries a loss given by prof.step(loss) after the optimizer ended the step. It was
    dropped as a step already seen: neither judged nor in the window."""
    losses = noisy(100, 2.0, 4)
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0})
    watch.observe(StepValue(s, losses[s - 1], 1.0) for s in range(1, 100))
    watch.observe([StepValue(100, None, 1.0)])  # its loss not given yet
    watch.observe([StepValue(100, 50.0, 1.0), StepValue(101, 2.0, 1.0)])  # the late loss
    loss = watch.counts()[LOSS_SPIKE]
    assert (loss.count, loss.first.step, loss.first.value) == (1, 100, 50.0)
    watch.observe([StepValue(100, 60.0, 1.0)])  # judged once
    assert watch.counts()[LOSS_SPIKE].count == 1


def test_a_flat_window_does_not_keep_an_event_open_a_hair_above_its_median():
    """Review: with a window that does not vary (a loss stuck at one value), z is infinite
    a hair above the median, and the event went on past its spike, swallowing the next."""
    values = [1.0] * 300
    values[200 - 1] = 10.0
    for step in range(201, 231):
        values[step - 1] = 1.0001
    values[231 - 1] = 10.0
    watch = SpikeWatch(WINDOW, {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0})
    watch.observe(StepValue(s, values[s - 1], None) for s in range(1, 301))
    loss = watch.counts()[LOSS_SPIKE]
    assert (loss.count, loss.first.step, loss.last.step) == (2, 200, 231)


def test_the_judge_defaults_are_configs():
    """An Aggregator built without a config (tests, tools) judges as Config's defaults do."""
    from hookprof.config import Config
    from hookprof.publish.spikes import DEFAULT_THRESHOLDS

    c = Config()
    assert DEFAULT_THRESHOLDS == {
        LOSS_SPIKE: c.loss_spike_z,
        GRAD_NORM_SPIKE: c.grad_norm_spike_z,
        UPDATE_RATIO_JUMP: c.update_ratio_jump_z,
    }


def ratios_of(layers: list[str], n: int, seed: int) -> list[dict[str, float]]:
    """`n` measurements of healthy update ratios of `layers` (1e-3, 5% noise), all measured."""
    rng = np.random.default_rng(seed)
    return [
        {layer: 1e-3 * (1 + 0.05 * rng.standard_normal()) for layer in layers} for _ in range(n)
    ]


@pytest.mark.parametrize("afterwards", ["not measured", "no update", "non-finite"])
def test_a_jump_whose_layer_stops_being_judged_ends_and_hides_no_later_jump(afterwards):
    """Found in review (issue 43): an event lasted until its layer was next measured below half
    the rule's limits. A layer frozen mid-event (no longer measured), given a learning rate of
    0 (its ratio exactly 0, neither judged nor kept) or whose updates went NaN (the NaN checks')
    was never judged again, so its event never ended and every later jump of any layer was
    hidden. Such an event now ends once its layer has gone unjudged for EXPIRY_GAPS of its
    usual gaps between measurements."""
    measured = ratios_of(["a", "b"], 100, 0)
    measured[40]["a"] = 40e-3  # measurement 41: a's jump
    for later in measured[41:]:
        if afterwards == "not measured":
            del later["a"]
        else:
            later["a"] = 0.0 if afterwards == "no update" else math.nan
    measured[80]["b"] = 40e-3  # measurement 81: b's jump, long after a's
    watch = SpikeWatch(WINDOW, {UPDATE_RATIO_JUMP: 12.0})
    for step, ratios in enumerate(measured, 1):
        watch.observe_update_ratios(10 * step, ratios)
    jump = watch.counts()[UPDATE_RATIO_JUMP]
    assert (jump.count, jump.first.step, jump.first.layer) == (2, 410, "a")
    assert (jump.last.step, jump.last.layer) == (810, "b")


def test_a_jump_that_reaches_the_layers_on_their_turns_stays_one_event():
    """Layers measured in turns (one of four per measurement): a learning rate too large for a
    while reaches each on its turn, measurements apart, and stays one event; a layer's event
    is not ended by the measurements of the others' turns (its usual gap is four), only when
    its own turns stop judging it. A later jump is an event of its own."""
    layers = ["a", "b", "c", "d"]
    healthy = ratios_of(layers, 120, 1)
    measured = []
    for k, ratios in enumerate(healthy):
        layer = layers[k % 4]
        value = ratios[layer]
        if 88 <= k < 96:  # two rounds of turns at 10x
            value *= 10
        measured.append({layer: value})
    measured.append({"a": 40e-3})  # a second jump, after every layer is back to normal
    watch = SpikeWatch(WINDOW, {UPDATE_RATIO_JUMP: 12.0})
    for step, ratios in enumerate(measured, 1):
        watch.observe_update_ratios(step, ratios)
    jump = watch.counts()[UPDATE_RATIO_JUMP]
    assert (jump.count, jump.first.step, jump.first.layer) == (2, 89, "a")
    assert (jump.last.step, jump.last.layer) == (121, "a")
