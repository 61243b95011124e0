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
    assert all(0.0015 < medians[s - 1] < 0.0035 for s in range(5, 11)), medians
    # 4 ms from step 9 on: the median moves with the third slow step, not before
    assert medians[10 - 1] < 0.0035 < 0.0038 < medians[11 - 1], medians
    assert backward is not None and backward > 0
