"""EveryStep, the publisher's store of every step's loss and gradient norm: bands that merge
as the run grows, against values computed apart; repeated steps; the incident's lead-up."""

from __future__ import annotations

import math
import random

import pytest

from hookprof.publish.every_step import EveryStep
from hookprof.step.series import StepValue


def _values(n, seed=0, bad=()):
    rng = random.Random(seed)
    out = []
    for s in range(1, n + 1):
        loss = None if s % 7 == 0 else rng.lognormvariate(0, 1)
        norm = rng.uniform(0.1, 5.0)
        if s in bad:
            loss, norm = math.nan, math.inf
        out.append(StepValue(s, loss, norm, None if s % 11 == 0 else rng.uniform(0.01, 0.02)))
    return out


def _expect(values, first, last, k):
    vs = [getattr(v, k) for v in values if first <= v.step <= last]
    return [v for v in vs if v is not None and math.isfinite(v)], sum(
        1 for v in vs if v is not None and not math.isfinite(v)
    )


@pytest.mark.parametrize("n", [40, 97, 1000])
def test_bands_hold_every_step_that_left_the_recent_window(n):
    values = _values(n, bad={30, 31, 500})
    store = EveryStep(full=16, lead_up=4, max_bands=8)
    for start in range(0, n, 5):  # drains of 5 steps, each repeating the one before
        store.observe(values[max(start - 1, 0) : start + 5])
    view = store.view()
    bands = view["bands"]
    assert len(bands["first"]) <= 8
    covered = [
        s for f, la in zip(bands["first"], bands["last"]) for s in range(int(f), int(la) + 1)
    ]
    assert covered == list(range(1, n - 16 + 1))
    assert all(la - f + 1 <= view["stride"] for f, la in zip(bands["first"], bands["last"]))
    for i, (f, la) in enumerate(zip(bands["first"], bands["last"])):
        for k in ("loss", "grad_norm", "step_seconds"):
            finite, bad = _expect(values, f, la, k)
            assert bands[f"{k}_n"][i] == len(finite) and bands[f"{k}_bad"][i] == bad
            if finite:
                assert bands[f"{k}_min"][i] == pytest.approx(min(finite))
                assert bands[f"{k}_max"][i] == pytest.approx(max(finite))
                assert bands[f"{k}_mean"][i] == pytest.approx(sum(finite) / len(finite))
            else:
                assert bands[f"{k}_min"][i] is None
    # the last 16 steps exact; the incident (step 30) and its lead-up kept for good
    assert view["incident"] == 30
    full = view["full"]
    recent = range(n - 15, n + 1)
    lead_up = [s for s in range(30 - 4, 30 + 32 + 1) if s < recent[0]]  # (AFTER: 32)
    assert full["step"] == [float(s) for s in (*lead_up, *recent)]
    for s, loss in zip(full["step"], full["loss"]):
        want = values[int(s) - 1].loss
        assert loss == (None if want is None else (want if math.isfinite(want) else math.inf))


def test_a_repeated_step_fills_what_it_lacked():
    store = EveryStep(full=8)
    store.observe([StepValue(1, None, 2.0, 0.1), StepValue(2, None, 3.0)])
    # step 2's late loss, and its time (it came as step 3 began)
    store.observe([StepValue(2, 0.5, 3.0, 0.2), StepValue(3, 0.25, 1.0)])
    store.observe([StepValue(3, None, 1.0)])  # nothing new: the loss stays
    assert store.view()["full"] == {
        "step": [1.0, 2.0, 3.0],
        "loss": [None, 0.5, 0.25],
        "grad_norm": [2.0, 3.0, 1.0],
        "step_seconds": [0.1, 0.2, None],
    }


def test_the_counters_first_step_wins_over_a_later_bad_value():
    """A layer's output went NaN at step 5 while the loss stayed finite until step 6."""
    store = EveryStep(full=64, lead_up=2)
    store.observe([StepValue(s, 1.0 if s < 6 else math.nan, 1.0) for s in range(1, 9)], incident=5)
    assert store.view()["incident"] == 5
    assert store.lead_up[0][0] == 3.0
