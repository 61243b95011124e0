"""hookprof_step_phase_device_seconds with stand-in CUDA events: there is no GPU here.

The profiler runs with the real CudaEventTimer over tests/support/fake_gpu.py's events, stamped by a
simulated stream (fake_gpu.QueuedDevice): the model, the loop and the optimizer advance the
host's fake clock and launch "kernels" of known lengths, and an event's time is when the
stream reaches it (max of the host's time and the end of the work queued before it). The
expected device seconds per phase are worked out by hand in each test from that schedule,
independently of hookprof; the real thing is everything else: the hooks, the marks, the
publisher's resolution and fold, the exporter, the HTTP page, promtool.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn

import hookprof
from hookprof.device.timing import CudaEventTimer
from support.binaries import promtool
from support.fake_gpu import FakeStream, QueuedDevice
from support.metrics import parse, samples, scrape
from support.phase_clock import FakeClock, phases

PHASES = ("data", "forward", "backward", "optimizer", "other")


class DeviceNet(nn.Module):
    """Its forward takes `host_ms` of the host, then launches `kernel_ms` of device work."""

    def __init__(self, clock: FakeClock, device: QueuedDevice, host_ms: float, kernel_ms: float):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.clock, self.device, self.host_ms, self.kernel_ms = clock, device, host_ms, kernel_ms

    def forward(self, x):
        self.clock.advance(self.host_ms)
        self.device.launch(self.kernel_ms)
        return self.fc(x)


class DeviceSGD(torch.optim.SGD):
    """An update of `host_ms` on the host that launches `kernel_ms` on the device (its step
    calls SGD's, so the optimizer hooks run twice, as in test_step_phases.TimedSGD)."""

    def __init__(
        self, params, clock: FakeClock, device: QueuedDevice, host_ms: float, kernel_ms: float
    ):
        super().__init__(params, lr=0.01)
        self.clock, self.device, self.host_ms, self.kernel_ms = clock, device, host_ms, kernel_ms

    def step(self, closure=None):
        self.clock.advance(self.host_ms)
        self.device.launch(self.kernel_ms)
        return super().step(closure)


def device_profiler(model, clock, device, **overrides):
    """Sampled every step unless overridden; the timer is the real CudaEventTimer."""
    stream = FakeStream()
    timer = CudaEventTimer(event_factory=device.event, current_stream=lambda: stream)
    config = hookprof.Config(
        **{
            "port": 0,
            "stall_detection": False,
            "sample_every": 1,
            "min_sample_interval_s": 0.0,
            **overrides,
        }
    )
    return hookprof.Profiler(model, config, clock=clock, timer=timer), stream


def rig(forward_ms: tuple[int, int], update_ms: tuple[int, int], **overrides):
    """A fake clock and device, a DeviceNet and a DeviceSGD taking (host, kernel) ms, and a
    profiler over them: (clock, device, model, optimizer, (profiler, stream))."""
    clock = FakeClock()
    device = QueuedDevice(clock)
    model = DeviceNet(clock, device, *forward_ms)
    opt = DeviceSGD(model.parameters(), clock, device, *update_ms)
    return clock, device, model, opt, device_profiler(model, clock, device, **overrides)


def device_phases(prof) -> tuple[int, dict[str, float]]:
    prof.flush()
    snap = prof.snapshot()
    return snap.device_phase_steps, {
        k: round(v * 1e3, 6) for k, v in snap.device_phase_seconds.items()
    }


def backward_with_kernels(loss, clock, device, host_ms, kernel_ms):
    loss.backward()
    clock.advance(host_ms)
    device.launch(kernel_ms)


def test_device_bound_loop_shows_each_phase_s_kernels_and_the_page_passes_promtool():
    """Per step: data 5 ms (host), forward 1 ms host + 6 ms kernels, backward 2 + 9, optimizer
    1 + 3, logging 2 ms, prof.step(). The host needs 11 ms a step, the device 18: after the
    first launch the stream never catches up, so every mark waits for the work queued before
    it and a phase's device time is its own kernels: data 0, forward 6, backward 9, optimizer
    3, other 0. Step 1 only: the stream is idle when its forward begins (attach at 10 ms,
    clock restarted at 15), so its forward is 1 + 6 (the stream waits for the launch)."""
    clock, device, model, opt, (prof, _) = rig((1, 6), (1, 3))
    x = torch.randn(8, 4)
    try:
        for _ in range(4):
            clock.advance(5)
            loss = model(x).pow(2).mean()
            backward_with_kernels(loss, clock, device, 2, 9)
            opt.step()
            opt.zero_grad()
            clock.advance(2)
            prof.step(loss)
        assert device_phases(prof) == (
            4,
            {"data": 0.0, "forward": 25.0, "backward": 36.0, "optimizer": 12.0, "other": 0.0},
        )
        # the host's figures are the host's (test_step_phases' plain loop, these lengths)
        assert phases(prof) == {
            "data": 17.0,
            "forward": 4.0,
            "backward": 8.0,
            "optimizer": 4.0,
            "other": 6.0,
        }
        text = scrape(prof.url)
        page = parse(text)
        count = samples(
            page, "hookprof_step_phase_device_seconds", "hookprof_step_phase_device_seconds_count"
        )
        total = samples(
            page, "hookprof_step_phase_device_seconds", "hookprof_step_phase_device_seconds_sum"
        )
        assert count == {frozenset({"rank": "0", "phase": p}.items()): 4.0 for p in PHASES}
        expected = {
            "data": 0.0,
            "forward": 0.025,
            "backward": 0.036,
            "optimizer": 0.012,
            "other": 0.0,
        }
        assert {dict(k)["phase"]: v for k, v in total.items()} == pytest.approx(expected, abs=1e-12)
        result = subprocess.run(
            [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        prof.detach()


def test_host_bound_loop_shows_the_device_idle_while_the_host_loads_data():
    """Per step: data 20 ms, forward 1 ms host + 2 ms kernels, backward 3 + 4, optimizer 1 + 1;
    the optimizer ends the step. Step 1 (clock restarted at 30 ms, stream idle): forward 30 to
    33 (3: the launch at 31, then 2 of kernels), backward 33 to 38 (the host launches at 34,
    the kernels end at 38: 5), optimizer 38 to 39 (1), other 0; step 2's first mark is at 39
    while the host is at 35. Its forward starts at host 55: data is 55 - 39 = 16, the 20 ms of
    loading less the 4 ms the stream still ran step 1's kernels; the rest repeats. So each
    later device step lasts 16 + 3 + 5 + 1 = 25 ms, the host's step time."""
    clock, device, model, opt, (prof, _) = rig((1, 2), (1, 1))
    x = torch.randn(8, 4)
    try:
        for _ in range(3):
            clock.advance(20)
            backward_with_kernels(model(x).pow(2).mean(), clock, device, 3, 4)
            opt.step()
            opt.zero_grad()
        assert device_phases(prof) == (
            3,
            {"data": 32.0, "forward": 9.0, "backward": 15.0, "optimizer": 3.0, "other": 0.0},
        )
        snap = prof.snapshot()
        assert snap.step_duration_sum == pytest.approx(0.005 + 0.025 + 0.025, abs=1e-12)
    finally:
        prof.detach()


def test_closure_optimizer():
    """LBFGS with a closure: 2 ms of host in the optimizer before each forward, forward 3 ms
    host + 1 ms kernel, backward 4 + 1; data 5 ms. Each closure call: forward mark to output
    mark 4 (3 of host, then the kernel), backward 4 (host 4, kernel launched last, then 1 more
    ms of it: the next mark is at host + 1); back in the optimizer the stream is 1 ms behind
    the host, so the 2 ms before the next forward show as 1. Step 1 (clock restarted at its
    first forward): optimizer (calls - 1) x 1. A later step: its data is the 5 ms of loading
    less the 1 ms of the previous backward's kernel still running (4), and its optimizer
    2 (before the first forward: the stream has caught up) + (calls - 1) x 1."""
    clock = FakeClock()
    device = QueuedDevice(clock)
    model = DeviceNet(clock, device, host_ms=3, kernel_ms=1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    prof, _ = device_profiler(model, clock, device)
    x, calls = torch.randn(8, 4), []

    def closure():
        calls.append(1)
        opt.zero_grad()
        clock.advance(2)
        loss = model(x).pow(2).mean()
        backward_with_kernels(loss, clock, device, 4, 1)
        return loss

    try:
        for _ in range(3):
            clock.advance(5)
            opt.step(closure)
        n = len(calls)
        assert n > 3  # several closure calls per step
        assert device_phases(prof) == (
            3,
            {
                "data": 8.0,
                "forward": 4.0 * n,
                "backward": 4.0 * n,
                "optimizer": n + 1.0,
                "other": 0.0,
            },
        )
    finally:
        prof.detach()


def test_evaluation_and_expect_slow_count_as_other_on_the_device_too():
    """Forward 1 ms host + 3 kernel, backward 2 + 4, optimizer 1 + 1 (it ends the step), data 5.
    Step 1 (from 15 ms): forward 15 to 19 (4), backward 19 to 23 (4), optimizer 23 to 24 (1).
    Step 2 begins at device 24 (host 19): 4 ms of waiting, then an evaluation forward at host
    23 (the stream reaches that mark at 24: data 0), its 3 ms kernel, 6 ms, a 20 ms
    expect_slow section, 5 ms of loading: outside from 24 to host 55 = 31, counted as other;
    then forward 4, backward 4, optimizer 1 as in step 1. The host's other is 32 (from 23)."""
    clock, device, model, opt, (prof, _) = rig((1, 3), (1, 1))
    x = torch.randn(8, 4)

    def train_step():
        clock.advance(5)
        backward_with_kernels(model(x).pow(2).mean(), clock, device, 2, 4)
        opt.step()
        opt.zero_grad()

    try:
        train_step()
        clock.advance(4)
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        clock.advance(6)
        with prof.expect_slow("checkpoint"):
            clock.advance(20)
        train_step()
        assert device_phases(prof) == (
            2,
            {"data": 0.0, "forward": 8.0, "backward": 8.0, "optimizer": 2.0, "other": 31.0},
        )
        assert phases(prof) == {
            "data": 4.0,
            "forward": 2.0,
            "backward": 4.0,
            "optimizer": 2.0,
            "other": 32.0,
        }
    finally:
        prof.detach()


def test_micro_batches():
    """Two micro-batches per step (load 5 ms, forward 1 + 6, backward 2 + 9), then the update
    (1 + 3) and prof.step(). Device-bound after the first launch: each forward 6, each
    backward 9 (the second backward stretch, from the second output to the optimizer, also
    9; the first, from the first output to the second forward, holds the first backward's
    kernels), optimizer 3; step 1's first forward 7 (idle stream)."""
    clock, device, model, opt, (prof, _) = rig((1, 6), (1, 3))
    x = torch.randn(8, 4)
    try:
        for _ in range(3):
            for _ in range(2):
                clock.advance(5)
                backward_with_kernels(model(x).pow(2).mean() / 2, clock, device, 2, 9)
            opt.step()
            opt.zero_grad()
            prof.step()
        assert device_phases(prof) == (
            3,
            {"data": 0.0, "forward": 37.0, "backward": 54.0, "optimizer": 9.0, "other": 0.0},
        )
    finally:
        prof.detach()


def test_unsampled_steps_record_no_event():
    """Only sampled steps are marked: after step 1, none of the next steps is sampled, and
    none records an event; the totals hold step 1 alone."""
    clock, device, model, opt, (prof, stream) = rig((1, 6), (1, 3), sample_every=1000)
    x = torch.randn(8, 4)
    try:
        recorded = []
        for _ in range(4):
            recorded.append(stream.recorded)
            clock.advance(5)
            backward_with_kernels(model(x).pow(2).mean(), clock, device, 2, 9)
            opt.step()
            opt.zero_grad()
        assert recorded[2] == recorded[1] and stream.recorded == recorded[1]  # steps 2-4: none
        assert prof.steps == 4
        assert device_phases(prof) == (
            1,
            {"data": 0.0, "forward": 7.0, "backward": 9.0, "optimizer": 3.0, "other": 0.0},
        )
    finally:
        prof.detach()


def test_absent_with_the_cpu_timer():
    """On the host clock the device figure would repeat the host one: not exported."""
    clock = FakeClock()
    model = DeviceNet(clock, QueuedDevice(clock), host_ms=1, kernel_ms=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.Profiler(
        model,
        hookprof.Config(port=0, stall_detection=False, sample_every=1, min_sample_interval_s=0.0),
        clock=clock,
    )
    try:
        assert prof.timer.kind == "cpu"
        for _ in range(2):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        prof.flush()
        snap = prof.snapshot()
        assert snap.sampled_steps == 2
        assert snap.device_phase_seconds is None and snap.device_phase_steps == 0
        page = parse(scrape(prof.url))
        assert "hookprof_step_phase_device_seconds" not in page
        assert "hookprof_step_phase_seconds" in page
    finally:
        prof.detach()
