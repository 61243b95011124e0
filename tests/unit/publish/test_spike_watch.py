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
    hidden. Such an event now ends once its layer has gone unjudged for longer than is
    usual for it (step/jump_events.py)."""
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


def turns(layers: list[str], rounds: int, seed: int) -> list[dict[str, float]]:
    """Healthy ratios of `layers` measured in turns, one layer per measurement."""
    healthy = ratios_of(layers, rounds, seed)
    return [{layer: healthy[r][layer]} for r in range(rounds) for layer in layers]


def jumps(measured: list[dict[str, float]]) -> tuple[int, list[tuple[int, str]]]:
    """The rule's events over `measured` (one measurement per step): (count, [(first step,
    layer), (last step, layer)])."""
    watch = SpikeWatch(WINDOW, {UPDATE_RATIO_JUMP: 12.0})
    for step, ratios in enumerate(measured, 1):
        watch.observe_update_ratios(step, ratios)
    jump = watch.counts()[UPDATE_RATIO_JUMP]
    ends = [(e.step, e.layer) for e in (jump.first, jump.last) if e is not None]
    return jump.count, ends


def test_an_event_goes_on_from_one_of_its_layers_turns_to_the_next():
    """Review: a layer's event must not end between its own turns (layers measured one per
    measurement: its turns are four measurements apart). a jumps at measurement 89; its next
    turn (93) is 3x its median, above half the rule's limits: the event goes on, so b's jump
    at 94 is part of it. Healthy turns after that; c's jump at 131 is a second event."""
    measured = turns(["a", "b", "c", "d"], 40, 1)
    measured[88]["a"] *= 10
    measured[92]["a"] *= 3
    measured[93]["b"] *= 10
    measured[130]["c"] *= 10
    assert jumps(measured) == (2, [(89, "a"), (131, "c")])
    # the control: a's next turn healthy, its event ends there and b's jump is one of its own
    measured[92]["a"] /= 3
    assert jumps(measured) == (3, [(89, "a"), (131, "c")])


def test_an_event_goes_on_when_a_parameter_group_joins_and_the_turns_grow_longer():
    """Review: twelve layers that join mid-event (progressive unfreezing) lengthen the
    rotation from 4 measurements to 16: a's next turn after its jump comes 16 measurements
    later, still 3x its median; the event goes on, and b's jump after it is part of it."""
    measured = turns(["a", "b", "c", "d"], 30, 2)
    measured[116]["a"] = 10e-3  # measurement 117: a's jump
    measured += [{layer: 1e-3} for layer in "efghijklmnop"]
    measured += [{"a": 3e-3}, {"b": 10e-3}]  # a's next turn (133), then b's (134)
    assert jumps(measured) == (1, [(117, "a"), (117, "a")])
    measured[-2]["a"] = 1e-3  # the control: a back to normal ends it; b's is a new event
    assert jumps(measured) == (2, [(117, "a"), (134, "b")])


def test_a_layers_usual_runs_without_an_update_keep_its_event_and_a_long_pause_does_not():
    """Review: a head updated on some steps only (its task absent: ratio 0) has runs of
    turns without an update; its event goes on through a run up to three times its longest
    recent one (3 here: 9), and ends after a longer one. Its usual run is counted as at most
    64, so one long pause (300 turns) does not keep a later event open for 900."""
    rng = np.random.default_rng(4)

    def healthy() -> float:
        return 1e-3 * (1 + 0.05 * rng.standard_normal())

    measured = [
        {"h": 0.0 if m % 7 in (1, 2, 3) else healthy(), "b": healthy()} for m in range(1, 61)
    ]
    measured.append({"h": 10e-3, "b": healthy()})  # 61: h's jump
    measured += [{"h": 0.0, "b": healthy()} for _ in range(9)]  # 62-70: a run of 9
    measured.append({"h": 0.0, "b": 10e-3})  # 71: b's jump, within h's event
    measured += [{"h": healthy(), "b": healthy()} for _ in range(28)]
    measured.append({"h": healthy(), "b": 10e-3})  # 100: a second event
    assert jumps(measured) == (2, [(61, "h"), (100, "b")])
    # the control: a run of 10 before b's jump (10 > 9): h's event has ended, b's is new
    measured[70]["b"] = healthy()
    measured.insert(71, {"h": 0.0, "b": 10e-3})
    assert jumps(measured) == (3, [(61, "h"), (101, "b")])
    # one pause of 300 turns, back for 30, a jump, then frozen: b's jump 200 turns later
    # (more than 3 x 64) is an event of its own
    measured = [{"h": healthy(), "b": healthy()} for _ in range(40)]
    measured += [{"h": 0.0, "b": healthy()} for _ in range(300)]
    measured += [{"h": healthy(), "b": healthy()} for _ in range(30)]
    measured.append({"h": 10e-3, "b": healthy()})  # 371
    measured += [{"h": 0.0, "b": healthy()} for _ in range(200)]
    measured.append({"h": 0.0, "b": 10e-3})  # 572
    assert jumps(measured) == (2, [(371, "h"), (572, "b")])


def test_one_long_absence_does_not_keep_a_later_event_open():
    """Review: a layer away for 100 measurements (its weights at 0, then restored) comes back,
    jumps on its fifth turn back and goes away again: its usual gap between turns is the
    median of its last eight (1 here: 101, 1, 1, 1, 1), not the longest, so its event ends 8
    measurements on and b's jump 30 later is an event of its own (with the longest, 808
    measurements would have hidden it)."""
    rng = np.random.default_rng(5)

    def healthy() -> float:
        return 1e-3 * (1 + 0.05 * rng.standard_normal())

    measured = [{"h": healthy(), "b": healthy()} for _ in range(40)]
    measured += [{"b": healthy()} for _ in range(100)]
    measured += [{"h": healthy(), "b": healthy()} for _ in range(4)]
    measured.append({"h": 10e-3, "b": healthy()})  # 145
    measured += [{"b": healthy()} for _ in range(29)]
    measured.append({"b": 10e-3})  # 175
    assert jumps(measured) == (2, [(145, "h"), (175, "b")])
