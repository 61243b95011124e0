"""An update ratio jump's verdict from its two replays (publish/spikes.py `_jump_verdict`):
the update's second run and, where the jump's gate tripped, its step's forward and backward.
A review's findings: the combined verdict must stand once either side has forgotten the step
(each keeps its last 64), and an update that was not compared must keep the replay's
capsule and the batch's samples of largest loss."""

from __future__ import annotations

import numpy as np
import torch

from hookprof.integrity.update_replay import _per_layer
from hookprof.publish.spikes import DEFAULT_THRESHOLDS, UPDATE_RATIO_JUMP, SpikeWatch
from hookprof.step.update_statistics import AroundUpdate, LayerSums

JUMP = 31
# (result, capsule, the first differing layer, the batch's samples, the phase)
REPLAY_DIFFERED = ("not_reproduced", "/c/batch.pt", "fc", None, "backward")
UPDATE_ALIKE = ("reproduced", "/c/update.pt", None, None, None)


def jumped() -> SpikeWatch:
    """A layer's ratio steady for 30 measurements, then 100x: one jump, at step JUMP."""
    watch = SpikeWatch(200, DEFAULT_THRESHOLDS)
    rng = np.random.default_rng(0)
    for step in range(1, JUMP):
        watch.observe_update_ratios(step, {"fc": 1e-3 * (1 + 0.05 * rng.standard_normal())})
    watch.observe_update_ratios(JUMP, {"fc": 1e-1})
    assert watch.counts()[UPDATE_RATIO_JUMP].first.step == JUMP
    return watch


def first(watch: SpikeWatch):
    return watch.counts()[UPDATE_RATIO_JUMP].first


def test_a_backward_that_differed_is_the_jumps_verdict_and_stands_once_forgotten():
    watch = jumped()
    watch.note_verdicts({JUMP: REPLAY_DIFFERED}, {JUMP: UPDATE_ALIKE})
    event = first(watch)
    said = (event.verdict, event.entered, event.entered_phase, event.capsule)
    assert said == ("not_reproduced", "fc", "backward", "/c/batch.pt")
    # 64 gate-tripped replays later the replays no longer hold the step: the verdict stands
    watch.note_verdicts({}, {JUMP: UPDATE_ALIKE})
    event = first(watch)
    assert (event.verdict, event.entered, event.entered_phase, event.capsule) == said


def test_an_update_not_compared_keeps_the_replays_capsule_and_samples():
    watch = jumped()
    samples = ((3, 1.5), (7, 1.25))
    watch.note_verdicts(
        {JUMP: ("reproduced", "/c/batch.pt", None, samples, None)},
        {JUMP: ("not_compared", None, None, None, None)},
    )
    event = first(watch)
    # (the replay says nothing of the update: still not compared, with the batch's capsule)
    assert (event.verdict, event.capsule, event.suspects) == (
        "not_compared",
        "/c/batch.pt",
        samples,
    )


def test_the_replay_alone_stands_until_the_update_comes():
    watch = jumped()
    watch.note_verdicts({JUMP: ("reproduced", "/c/batch.pt", None, None, None)}, {})
    assert first(watch).verdict == "reproduced"
    watch.note_verdicts(
        {JUMP: ("reproduced", "/c/batch.pt", None, None, None)},
        {JUMP: ("not_reproduced", None, "fc.weight", None, "update")},
    )
    event = first(watch)
    assert (event.verdict, event.entered, event.entered_phase) == (
        "not_reproduced",
        "fc.weight",
        "update",
    )


def test_a_model_on_several_devices_has_its_parts_added_up_for_the_gate():
    """The update norms' sums come as one part per device (a model split over two GPUs):
    the gate adds them up (it had given up: no gate and no capsule for such a model)."""

    def part(*values: float) -> torch.Tensor:  # (float64, as the update norms' parts)
        return torch.tensor(values, dtype=torch.float64)

    weights = LayerSums((part(1.0, 2.0, 0.0), part(0.0, 0.0, 3.0)), frozenset({0, 1, 2}))
    updates = LayerSums((part(0.1, 0.0, 0.0), part(0.0, 0.0, 0.2)), frozenset({0, 2}))
    found = _per_layer(AroundUpdate(weights, updates))
    assert found is not None
    layers, update, weight = found
    assert layers == {0, 2}
    assert update.tolist() == [0.1, 0.0, 0.2]
    assert weight.tolist() == [1.0, 2.0, 3.0]
