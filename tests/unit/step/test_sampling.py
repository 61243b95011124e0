"""Sampling is decided once per step; unsampled steps have no per-layer hooks at all."""

from __future__ import annotations

import hookprof
from hookprof.step.plan import Sampler
from support.hooks_left import forward_hooks
from support.models import DeepNet, seeded, train

SECOND = 1_000_000_000


def test_sampler_needs_both_steps_and_seconds():
    s = Sampler(every=3, min_interval_s=2.0)
    assert s.should_sample(1, 0)
    assert not s.should_sample(2, 5 * SECOND)  # enough time, too few steps
    assert not s.should_sample(4, 1 * SECOND)  # enough steps, too little time
    assert s.should_sample(4, 2 * SECOND)  # both
    assert not s.should_sample(6, 10 * SECOND)
    assert s.should_sample(7, 10 * SECOND)


def test_sampler_every_step():
    s = Sampler(every=1, min_interval_s=0.0)
    assert all(s.should_sample(i, 0) for i in range(1, 20))


def test_no_layer_hooks_on_unsampled_steps():
    model = seeded(DeepNet)
    seen = []

    def count_hooks(step, m):
        # a layer is instrumented by a wrapper of its forward (an instance attribute)
        seen.append(sum(len(forward_hooks(mod)) + ("forward" in vars(mod)) for mod in m.modules()))

    with hookprof.attach(model, port=0, sample_every=4, min_sample_interval_s=0.0) as prof:
        train(model, 9, on_step=count_hooks)
        prof.flush()
        assert prof.snapshot().sampled_steps == 3
    layers = len(model.order())
    # on the root: a pre-hook that notices a new step, a hook that checks the model output
    root_hooks = 2
    assert seen == [
        layers + root_hooks if step in (1, 5, 9) else root_hooks for step in range(1, 10)
    ]


def test_min_interval_limits_sampling_of_fast_loops():
    model = seeded(DeepNet)
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=3600.0) as prof:
        train(model, 20)
        prof.flush()
        snap = prof.snapshot()
    assert (snap.step, snap.sampled_steps, snap.last_sampled_step) == (20, 1, 1)
