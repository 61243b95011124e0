"""Per-layer times: positive where a layer ran, exclusive of instrumented children, summing
to no more than the step; shared modules and micro-batches add up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.device.timing import CpuTimer
from support.models import DeepNet, MixedNet, profiled, seeded


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


class VirtualClock:
    """A perf_counter_ns that moves only when the model says: the times hookprof reports are
    then known exactly, whatever else the machine is doing."""

    def __init__(self):
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


class TakesTime(nn.Linear):
    """A layer whose forward takes `ns` on the virtual clock."""

    def __init__(self, clock: VirtualClock, ns: int):
        super().__init__(8, 8)
        self.clock, self.ns = clock, ns

    def forward(self, x):
        self.clock.advance(self.ns)
        return super().forward(x)


class OwnsParamAndChildren(nn.Module):
    """A module with a parameter of its own and instrumented children (like a ViT's
    position embedding on the root): its time must not include theirs."""

    ROOT_NS, CHILD_NS = 3_000, 50_000

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self.clock = clock
        self.scale = nn.Parameter(torch.ones(8))
        self.inner = nn.Sequential(*[TakesTime(clock, self.CHILD_NS * (i + 1)) for i in range(6)])

    def forward(self, x):
        self.clock.advance(self.ROOT_NS)  # the root's own work, before and after its children
        y = self.inner(x * self.scale)
        self.clock.advance(self.ROOT_NS)
        return y


def test_parent_time_excludes_children():
    clock = VirtualClock()
    torch.manual_seed(0)
    model = OwnsParamAndChildren(clock)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = hookprof.Config(
        port=0, sample_every=1, min_sample_interval_s=0.0, stall_detection=False
    )
    steps = 5
    with hookprof.Profiler(model, config, clock=clock, timer=CpuTimer(clock)) as prof:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    root = snap.layers["(root)"]
    assert root.forward_calls_total == steps
    # exactly its own two advances per step, none of the children's
    assert root.forward_seconds_total == pytest.approx(steps * 2 * model.ROOT_NS * 1e-9)
    for i in range(6):
        child = snap.layers[f"inner.{i}"]
        assert child.forward_seconds_total == pytest.approx(steps * model.CHILD_NS * (i + 1) * 1e-9)
    # backward took no virtual time; the steps hold every forward (and the FLOP counting of
    # the first sampled step, which runs the layers' forward code on meta tensors)
    assert sum(s.backward_seconds_total for s in snap.layers.values()) == 0
    forward_ns = steps * (2 * model.ROOT_NS + model.CHILD_NS * 21)
    assert sum(s.forward_seconds_total for s in snap.layers.values()) == pytest.approx(
        forward_ns * 1e-9
    )
    assert snap.step_duration_sum >= forward_ns * 1e-9


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
