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


def test_aligned_ranks_sample_the_same_step_numbers_on_their_own_clocks():
    """Ranks of one job (aligned): the sampled steps are the multiples of `every` times a
    power of two that keeps the interval, so two ranks whose clocks and step times differ a
    little sample the same step numbers; where their estimates straddle a power of two, they
    still share every other sample."""
    every, interval = 3, 1.0
    step_ns = [0.05 * SECOND, 0.0502 * SECOND]  # rank 1 a little slower, its clock later
    offset = [0, 7_000_000]
    samplers = [Sampler(every, interval, aligned=True) for _ in range(2)]
    sampled: list[list[int]] = [[], []]
    for step in range(1, 2001):
        for r, s in enumerate(samplers):
            if s.should_sample(step, offset[r] + int(step * step_ns[r])):
                sampled[r].append(step)
    assert sampled[0] == sampled[1]
    assert sampled[0][:2] == [1, 3]  # the first step, then `every` before any step time is known
    # then a period of 3 x 8 = 24 steps (1.2 s at 50 ms: the least power of two above 1 s)
    assert all(b - a == 24 for a, b in zip(sampled[0][2:], sampled[0][3:]))
    assert all(s % 24 == 0 for s in sampled[0][3:])
    # the interval is kept on average: no two samples closer than it after the first period
    gaps = [(b - a) * 0.05 for a, b in zip(sampled[0][2:], sampled[0][3:])]
    assert min(gaps) >= interval


def test_aligned_ranks_whose_estimates_straddle_a_power_of_two_share_every_other_sample():
    a = Sampler(1, 1.0, aligned=True)
    b = Sampler(1, 1.0, aligned=True)
    seen: dict[str, set[int]] = {"a": set(), "b": set()}
    for step in range(1, 4001):
        if a.should_sample(step, int(step * 0.0157 * SECOND)):  # 1 s is 63.7 steps: period 64
            seen["a"].add(step)
        if b.should_sample(step, int(step * 0.0156 * SECOND)):  # 64.1 steps: period 128
            seen["b"].add(step)
    later_a = {s for s in seen["a"] if s > 200}
    later_b = {s for s in seen["b"] if s > 200}
    assert all(s % 64 == 0 for s in later_a) and all(s % 128 == 0 for s in later_b)
    assert later_b <= later_a and len(later_a) >= 2 * len(later_b) - 1


def test_unaligned_sampling_is_unchanged_by_the_aligned_mode():
    """A single process keeps `every` steps and the interval from its last sample."""
    s = Sampler(every=3, min_interval_s=0.0)
    assert [step for step in range(1, 12) if s.should_sample(step, 0)] == [1, 4, 7, 10]
