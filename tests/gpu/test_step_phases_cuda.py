"""Device time per step phase on a real GPU (hookprof_step_phase_device_seconds). Marked cuda:
skipped without a CUDA device; run with `python -m pytest -m cuda`. The logic is tested on
the CPU over a simulated stream (test_step_phases_device_no_gpu.py); this checks the real
events: no sync added, positive where the phase launched kernels, and bounded by the
stream's own time over the same steps."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hookprof
from support.metrics import parse, samples, scrape

pytestmark = pytest.mark.cuda

STEPS = 12
LOAD_S = 0.005  # the loop's "data loading" before each forward: the device idles meanwhile


def test_device_phases_on_cuda_add_no_sync_and_stay_within_the_stream_s_time():
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 1)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = [torch.randn(64, 256, device=device) for _ in range(STEPS)]
    ys = [torch.randn(64, 1, device=device) for _ in range(STEPS)]
    prof = hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, stall_detection=False
    )
    try:
        assert prof.timer.kind == "cuda"
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any sync on this thread raises
        try:
            begin.record()
            for x, y in zip(xs, ys):
                time.sleep(LOAD_S)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()  # ends the step
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        end.synchronize()
        stream_s = begin.elapsed_time(end) * 1e-3
        assert prof.flush(timeout=30)
        snap = prof.snapshot()
        assert snap.device_phase_steps == STEPS == snap.sampled_steps
        device_s = dict(snap.device_phase_seconds)
        for phase in ("forward", "backward", "optimizer"):  # each launched kernels
            assert device_s[phase] > 0, (phase, device_s)
        # every step's marks lie between begin and end on one stream, without overlap
        assert sum(device_s.values()) <= stream_s + 1e-4, (device_s, stream_s)
        # a small MLP leaves the GPU idle while the host sleeps: data shows it (step 1's
        # data is not seen: its clock starts at its first forward); half, for launch jitter
        assert device_s["data"] >= 0.5 * LOAD_S * (STEPS - 1), device_s
        page = parse(scrape(prof.url))
        count = samples(
            page, "hookprof_step_phase_device_seconds", "hookprof_step_phase_device_seconds_count"
        )
        assert set(count.values()) == {float(STEPS)} and len(count) == 5
    finally:
        prof.detach()
