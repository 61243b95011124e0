"""Each layer's recent time per call (issue 42: what the layer straggler rule compares across
ranks): the median of its last five sampled steps' mean per call (publish/recent.py),
against the per-step figures hookprof itself reported for those steps, read one sampled step
at a time. One preempted call leaves it; a slowdown that lasts three sampled steps moves it."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

import hookprof

SLOW_S = {3: 0.05, 9: 0.004, 10: 0.004, 11: 0.004}  # step -> seconds the layer sleeps
BASE_S = 0.002


class Sleeper(nn.Module):
    """A leaf layer that takes a set time per call on each step (the test's clock)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.seconds = BASE_S

    def forward(self, x):
        time.sleep(self.seconds)
        return x * self.weight


def test_the_recent_median_is_that_of_the_last_five_sampled_steps_and_ignores_one_slow_call():
    model = nn.Sequential(Sleeper(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    per_call, medians = [], []
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        for step in range(1, 13):
            model[0].seconds = SLOW_S.get(step, BASE_S)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            prof.flush()
            layer = prof.snapshot().layers["0"]
            per_call.append(layer.forward_seconds / layer.calls)  # this step's, as reported
            medians.append(layer.forward_seconds_per_call_median)
            backward = layer.backward_seconds_per_call_median
    assert medians[:4] == [None] * 4  # not known before five sampled steps
    for step in range(5, 13):
        assert medians[step - 1] == pytest.approx(statistics.median(per_call[step - 5 : step]))
    # step 3's one 50 ms call is in the windows of steps 5-7 and moves none of them
    assert all(medians[s - 1] < 0.01 for s in (5, 6, 7)), medians
    # (from step 7 on: steps 1-2 are start-up, which a loaded machine makes slow)
    assert all(0.0015 < medians[s - 1] < 0.0035 for s in range(7, 11)), medians
    # 4 ms from step 9 on: the median moves with the third slow step, not before
    assert medians[10 - 1] < 0.0035 < 0.0038 < medians[11 - 1], medians
    assert backward is not None and backward > 0


def test_a_layer_that_stops_running_has_no_recent_median():
    """Review: a row not called on later sampled steps (an expert of a mixture, a branch, an
    eval-only head) kept its last median forever, and with it a straggler alert or a place
    in the median of ranks. A row called on one sampled step of two keeps one."""
    from hookprof.publish.recent import RECENT_SAMPLES, STALE_AFTER, RecentPerCall

    recent = RecentPerCall(2)
    every_other = []
    for k in range(2 * RECENT_SAMPLES):  # row 0 every step at 5 ms, row 1 every other at 1 ms
        recent.add([0.005, 0.001 * (k % 2)], [1, k % 2])
        every_other.append(recent.median(1))
    assert recent.median(0) == 0.005 and every_other[-1] == 0.001
    assert every_other[: 2 * RECENT_SAMPLES - 1].count(None) == 2 * RECENT_SAMPLES - 1
    for _ in range(STALE_AFTER):  # neither row called again
        assert recent.median(0) == 0.005  # (stale only after STALE_AFTER of them)
        recent.add([0.0, 0.0], [0, 0])
    assert recent.median(0) is None and recent.median(1) is None
    recent.add([0.003, 0.0], [1, 0])  # called again: its five last calls, the new one in
    assert recent.median(0) == 0.005
