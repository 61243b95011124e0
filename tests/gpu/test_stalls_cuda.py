"""On a GPU: a training thread blocked on the device (a long kernel, then `.item()` waiting
for it) is reported with the host stack at the line that waits, waiting on "device"."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import hookprof
from support.metrics import parse, samples, scrape
from support.models import DeepNet, seeded

pytestmark = pytest.mark.cuda


def test_a_rank_blocked_on_the_device_shows_the_host_stack_that_waits():
    model = seeded(DeepNet).cuda()
    prof = hookprof.attach(
        model, port=0, stall_min_s=0.5, stall_warmup_steps=2, publish_interval_s=0.1
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    seen = {}

    def watch():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "info" not in seen:
            found = samples(parse(scrape(prof.url)), "hookprof_stall_info")
            if found:
                seen["info"] = dict(next(iter(found)))
                seen["stall"] = prof.snapshot().stall
            time.sleep(0.05)

    try:
        for step in range(1, 7):
            x, y = (t.cuda() for t in model.batch(g))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 5:
                thread = threading.Thread(target=watch, daemon=True)
                thread.start()
                torch.cuda._sleep(int(4e9))  # ~2-4 s of GPU cycles
                loss.item()  # the host waits here (phase "other": after the update)
        thread.join(35)
        assert seen["info"]["phase"] == "data" or seen["info"]["phase"] == "other", seen
        assert seen["info"]["waiting_on"] == "device"
        assert "loss.item()" in seen["stall"].stack[-1]
    finally:
        prof.detach()
