"""Non-finite values on sampled steps: counted for the layer that produced them and the
layers they flowed into, never for layers upstream."""

from __future__ import annotations

import math

import pytest
import torch

import hookprof
from hookprof.demo import InjectNonFinite
from hookprof.step.builtin_statistics import ZERO_SAMPLE
from support.models import DeepNet, seeded, train


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad", ["blocks.2.fc", "stem"])
def test_forward_nonfinite_counted_for_layer_and_downstream_only(bad, value, every_step):
    model = seeded(DeepNet)
    order = model.order()
    at = 3
    inject = InjectNonFinite(dict(model.named_modules())[bad], {at}, value)
    with hookprof.attach(model, **every_step) as prof:
        train(model, at, prof=prof, explicit_step=True)
        prof.flush()
        snap = prof.snapshot()
    inject.remove()

    position = order.index(bad)
    for name in order[:position]:
        assert snap.layers[name].nonfinite["forward"] == 0, f"{name} is upstream of {bad}"
    assert snap.layers[bad].nonfinite["forward"] == 1
    assert not math.isfinite(snap.layers[bad].activation_abs_max)
    # a NaN flows through everything after it; an Inf may turn into NaN, still non-finite
    for name in order[position + 1 :]:
        assert snap.layers[name].nonfinite["forward"] == 1, name
    assert snap.nonfinite_steps["forward"] == 1
    assert snap.nonfinite_steps["loss"] == 1
    # the producer, and the layers the value flowed through after it
    assert snap.first_nonfinite == hookprof.NonFiniteEvent(
        bad,
        "forward",
        at,
        tuple(order[position + 1 :]),
        found_by="sampled step",
        replay="transient",
    )  # the injector makes it at its 3rd call only: the replay is a 4th


def test_gradient_nonfinite_counted_for_the_layer(every_step):
    """A NaN put into one layer's weight gradient (a tensor hook in the test) is a backward
    incident of that layer only."""
    model = seeded(DeepNet)
    at = 2

    def poison(step, m):
        if step == at:
            m.blocks[3].fc.weight.grad[0, 0] = float("nan")

    with hookprof.attach(model, **every_step) as prof:
        train(model, at, on_step=poison)
        prof.flush()
        snap = prof.snapshot()
    bad = {n for n, s in snap.layers.items() if s.nonfinite["backward"]}
    assert bad == {"blocks.3.fc"}
    assert snap.layers["blocks.3.fc"].grad_norm != snap.layers["blocks.3.fc"].grad_norm  # NaN
    assert snap.nonfinite_steps == {"forward": 0, "backward": 1, "loss": 0}
    assert snap.first_nonfinite == hookprof.NonFiniteEvent(
        "blocks.3.fc", "backward", at, found_by="backward check"
    )


def test_activation_statistics_match_the_outputs(every_step):
    model = seeded(DeepNet)
    captured = {}
    handle = model.blocks[1].act.register_forward_hook(
        lambda m, a, out: captured.__setitem__("out", out.detach().clone())
    )
    with hookprof.attach(model, **every_step) as prof:
        train(model, 1, prof=prof, explicit_step=True)
        prof.flush()
        stats = prof.snapshot().layers["blocks.1.act"]
    handle.remove()
    out = captured["out"]
    assert stats.activation_abs_max == pytest.approx(out.abs().max().item())
    # the documented sample: every ceil(numel / ZERO_SAMPLE)-th value
    stride = -(-out.numel() // ZERO_SAMPLE)
    sample = out.flatten()[::stride]
    assert stats.activation_zero_ratio == pytest.approx((sample == 0).float().mean().item())
    assert 0 < stats.activation_zero_ratio < 1  # a ReLU on random data kills some units


def test_a_host_flag_is_counted_once_when_the_layers_are_on_another_device():
    """Detector.end_step's one-device path takes a host bool for the output only when it
    takes the step whole: a step whose gradients are elsewhere (a model moved mid-run) went
    down both paths, and its forward NaN was counted twice (review of issue 37's change)."""
    from hookprof.nonfinite.detector import PHASE_INDEX, Detector

    detector = Detector(3)
    detector.counters(torch.device("cpu"))
    detector.end_step([torch.zeros(3, device="meta")], [True], 5)
    forward = PHASE_INDEX["forward"]
    assert (detector.host_phase_bad[forward], detector.host_phase_first[forward]) == (1, 5)


def test_dropped_steps_fold_across_devices_to_the_earliest_ones_layers():
    """Two devices' counters (DeviceCounters, driven as the step's end drives them: the
    update's reading finite, the backward's as given): the dropped count is a step count (the
    larger, as for phases), the first dropped step the earlier device's, and its layers that
    device's kept backward values, not the later one's; a step dropped on both devices names
    both's layers."""
    from hookprof.nonfinite.detector import DeviceCounters, fold_counters

    nan = float("nan")

    def drive(counters, backward, step):
        counters.end_step(torch.zeros(3), None, step, backward=torch.tensor(backward))

    a, b = DeviceCounters(3, torch.device("cpu")), DeviceCounters(3, torch.device("cpu"))
    for step in range(1, 8):  # a drops steps 5 and 6, b step 3 only
        drive(a, {5: [nan, nan, 1.0], 6: [1.0, nan, 1.0]}.get(step, [1.0, 1.0, 1.0]), step)
        drive(b, [1.0, 1.0, nan] if step == 3 else [1.0, 1.0, 1.0], step)
    folded = fold_counters(
        [a.flat.tolist(), b.flat.tolist()],
        3,
        [a.dropped_values.tolist(), b.dropped_values.tolist()],
    )
    assert (folded["dropped_bad"], folded["dropped_first"], folded["dropped_layers"]) == (
        [2],
        [3],
        [0, 0, 1],
    )
    assert sum(folded["layer_bad"]) == 0 and folded["phase_bad"] == [0, 0, 0]  # no incident
    alone = fold_counters([a.flat.tolist()], 3, [a.dropped_values.tolist()])
    assert (alone["dropped_first"], alone["dropped_layers"]) == ([5], [1, 1, 0])
    c = DeviceCounters(3, torch.device("cpu"))
    drive(c, [1.0, nan, 1.0], 3)
    both = fold_counters(
        [b.flat.tolist(), c.flat.tolist()],
        3,
        [b.dropped_values.tolist(), c.dropped_values.tolist()],
    )
    assert (both["dropped_first"], both["dropped_layers"]) == ([3], [0, 1, 1])


def test_counters_past_2_24_fold_exactly_beside_the_kept_dropped_values():
    """Review of issue 38's dropped count: the kept values rode in the counters' batch as
    float32, and cat() promoted the int64 counters to float32 with them: a first step or a
    count past 2^24 came back rounded (16777217 -> 16777216), and merge_counters kept it."""
    from hookprof.nonfinite.detector import Detector, fold_counters
    from hookprof.step.record import pack_step

    det = Detector(3)
    step = 2**24 + 1
    det.end_step([torch.tensor([1.0, float("nan"), 2.0])], [], step)
    det.by_device[torch.device("cpu")].layer_bad[1] = 2**24 + 3
    packet = pack_step(step, None, det.blocks(), sampled=False, dropped_values=det.dropped_blocks())
    folded = fold_counters(
        [packet.batch.get(("counters", k)) for k in range(packet.counter_parts)],
        3,
        [packet.batch.get(("dropped", k)) for k in range(packet.dropped_parts)],
    )
    assert folded["layer_first"] == [-1, 2**24 + 1, -1]
    assert folded["layer_bad"] == [0, 2**24 + 3, 0]


def test_kept_dropped_values_are_never_cast_down_by_a_later_reading():
    """A first dropped step read in float64 (a square of 1e300: finite) stays finite when a
    later step's reading is float32: the layer is not named for an inf the cast made."""
    from hookprof.nonfinite.detector import DeviceCounters, fold_counters

    c = DeviceCounters(2, torch.device("cpu"))
    for step, backward in (
        (1, torch.tensor([1e300, float("nan")], dtype=torch.float64)),
        (2, torch.tensor([1.0, 1.0])),
    ):
        c.end_step(torch.zeros(2), None, step, backward=backward)
    folded = fold_counters([c.flat.tolist()], 2, [c.dropped_values.tolist()])
    assert folded["dropped_layers"] == [0, 1] and folded["dropped_first"] == [1]


def test_pending_slots_written_in_place_count_each_step_once_whatever_the_next_checks():
    """A device's pending findings are assigned by the checks that make them, not or-ed into
    a vector cleared every step: a finding of one step must not be counted again by a later
    step that did not make that check (no loss passed, no gradients read, one reading where
    the last step had two). And two readings are joined as StepGradients says: the layers
    are the backward's where both are non-finite, else the update's; the backward phase is
    bad when the update's reading is; a step non-finite at the backward's end and finite at
    the update is dropped (no incident, its layers kept). Driven through a random schedule
    of checks and values, against a tally kept here step by step."""
    import random

    from hookprof.nonfinite.detector import PHASE_INDEX, DeviceCounters, fold_counters

    rng = random.Random(7)
    n = 3
    counters = DeviceCounters(n, torch.device("cpu"))
    layer_bad, layer_first = [0] * n, [-1] * n
    phase_bad, phase_first = [0] * 3, [-1] * 3
    dropped_bad, dropped_first, dropped_layers = 0, -1, [0] * n
    kinds = set()

    def bump(bad, first, i, step):
        bad[i] += 1
        if first[i] < 0:
            first[i] = step

    def reading(p_bad):
        bad = [i for i in range(n) if rng.random() < p_bad]
        return bad, torch.tensor([float("nan") if i in bad else 1.0 for i in range(n)])

    for step in range(1, 300):
        if rng.random() < 0.6:  # a loss passed this step
            bad_loss = rng.random() < 0.2
            counters.note_loss(torch.tensor(float("nan") if bad_loss else 1.5))
            if bad_loss:
                bump(phase_bad, phase_first, PHASE_INDEX["loss"], step)
        values = backward = None
        if rng.random() < 0.7:  # gradients read where the update reads them
            update_bad, values = reading(0.15)
            counted = update_bad
            if rng.random() < 0.6:  # and as the backward ended
                backward_bad, backward = reading(0.2)
                if backward_bad and update_bad:  # a clip spread it: the backward names them
                    counted = backward_bad
                    kinds.add("both")
                elif backward_bad:  # dropped by the loop: no incident
                    dropped_bad += 1
                    if dropped_first < 0:
                        dropped_first = step
                        dropped_layers = [int(i in backward_bad) for i in range(n)]
                    kinds.add("dropped")
                elif update_bad:  # made after backward(): the update's own layers
                    kinds.add("after")
            for i in counted:
                bump(layer_bad, layer_first, i, step)
            if update_bad:
                bump(phase_bad, phase_first, PHASE_INDEX["backward"], step)
        forward = None
        if rng.random() < 0.7:  # the output checked
            bad_out = rng.random() < 0.2
            forward = torch.tensor(bad_out)
            if bad_out:
                bump(phase_bad, phase_first, PHASE_INDEX["forward"], step)
        counters.end_step(values, forward, step, backward)
    folded = fold_counters([counters.flat.tolist()], n, [counters.dropped_values.tolist()])
    assert kinds == {"both", "dropped", "after"}  # the schedule made each kind of join
    assert sum(phase_bad) > 10 and dropped_bad > 3
    assert folded["layer_bad"] == layer_bad and folded["layer_first"] == layer_first
    assert folded["phase_bad"] == phase_bad and folded["phase_first"] == phase_first
    assert (folded["dropped_bad"], folded["dropped_first"]) == ([dropped_bad], [dropped_first])
    assert folded["dropped_layers"] == dropped_layers
