"""Per-layer times: positive where a layer ran, exclusive of instrumented children, summing
to no more than the step; shared modules and micro-batches add up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import DeepNet, MixedNet, profiled, seeded


def test_forward_times_positive_and_sum_below_step_time(every_step):
    model = seeded(MixedNet)
    snap = profiled(model, 5, every_step, explicit_step=True)
    called = {n: s for n, s in snap.layers.items() if s.forward_calls_total}
    # every layer but the never-called attn.out_proj ran forward
    assert set(called) == set(snap.layers) - {"attn.out_proj"}
    for name, s in called.items():
        assert s.forward_seconds_total > 0, name
    total_forward = sum(s.forward_seconds_total for s in snap.layers.values())
    total_backward = sum(s.backward_seconds_total for s in snap.layers.values())
    assert 0 < total_forward + total_backward <= snap.step_duration_sum


def test_backward_times_for_every_layer_with_a_gradient(every_step):
    model = seeded(DeepNet)
    snap = profiled(model, 3, every_step, explicit_step=True)
    for name in model.order():
        s = snap.layers[name]
        assert s.backward_calls_total == 3, name
        assert s.backward_seconds_total > 0, name


def test_shared_module_accumulates_its_calls(every_step):
    model = seeded(MixedNet)
    snap = profiled(model, 4, every_step, explicit_step=True)
    assert snap.layers["shared"].calls == 2
    assert snap.layers["shared"].forward_calls_total == 8
    assert snap.layers["act"].forward_calls_total == 8
    assert snap.layers["head"].forward_calls_total == 4


def test_micro_batches_add_up_into_one_step(every_step):
    model = seeded(DeepNet)
    snap = profiled(model, 2, every_step, micro_batches=4)  # optimizer hooks end the steps
    assert snap.step == 2 and snap.sampled_steps == 2
    assert snap.layers["stem"].calls == 4
    assert snap.layers["stem"].forward_calls_total == 8
    assert snap.layers["head"].backward_calls_total == 8


class OwnsParamAndChildren(nn.Module):
    """A module with a parameter of its own and instrumented children (like a ViT's
    position embedding on the root): its time must not include theirs."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))
        self.inner = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x):
        return self.inner(x * self.scale)

    def batch(self, g):
        x = torch.randn(256, 64, generator=g)
        return x, x


def test_parent_time_excludes_children(every_step):
    model = seeded(OwnsParamAndChildren)
    snap = profiled(model, 5, every_step, explicit_step=True)
    root = snap.layers["(root)"]
    children = sum(snap.layers[f"inner.{i}"].forward_seconds_total for i in range(6))
    assert root.forward_calls_total == 5
    # the root's own work is one multiply; six 256x64x64 matmuls are far more
    assert root.forward_seconds_total < children
    total = sum(s.forward_seconds_total + s.backward_seconds_total for s in snap.layers.values())
    assert total <= snap.step_duration_sum


def test_step_duration_histogram_counts_every_step():
    model = seeded(DeepNet)
    snap = profiled(model, 10, dict(port=0, sample_every=4, min_sample_interval_s=0.0))
    assert snap.step == 10
    assert snap.sampled_steps == 3  # steps 1, 5, 9
    assert snap.last_sampled_step == 9
    assert snap.step_duration_buckets[-1] == (float("inf"), 10)
    counts = [c for _, c in snap.step_duration_buckets]
    assert counts == sorted(counts)
    assert snap.step_duration_sum > 0
    assert snap.last_step_timestamp == pytest.approx(__import__("time").time(), abs=60)
