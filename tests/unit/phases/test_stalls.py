"""The stall watch in one process, as it happens: a layer that blocks in its forward, a
DataLoader worker that sleeps, a long section inside expect_slow, a slow first step. Each is
watched through the real /metrics page while the training thread is stuck."""

from __future__ import annotations

import threading
import time

import torch

import hookprof
from hookprof import _testing
from support.metrics import parse, samples, scrape
from support.models import DeepNet, seeded
from support.stalling import Sleeper, SlowItems

FAST = dict(port=0, stall_min_s=0.3, stall_factor=5.0, stall_warmup_steps=2, publish_interval_s=0.1)
# for the tests that expect no stall: a floor no step of these small models reaches, even on
# a busy 2-core machine, below the sleeps the tests make
QUIET = {**FAST, "stall_min_s": 1.0}


def page(prof) -> dict:
    return parse(scrape(prof.url))


def stall_info(families) -> dict:
    found = samples(families, "hookprof_stall_info")
    return {k: v for k, v in ((dict(k)["phase"], dict(k)) for k in found)} if found else {}


def watch_page(prof, until, timeout: float = 15.0, then=None):
    """Scrape from another thread until `until(families)` holds; returns those families."""
    seen: dict = {}

    def poll():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = scrape(prof.url)
            families = parse(text)
            if until(families):
                seen["families"], seen["snapshot"], seen["text"] = families, prof.snapshot(), text
                seen["at"] = time.monotonic()
                break
            time.sleep(0.05)
        if then is not None:
            then()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    return thread, seen


def test_a_layer_blocked_in_its_forward_is_named_with_phase_step_and_stack(caplog):
    release, started = threading.Event(), {}
    model = seeded(DeepNet)
    model.blocks[2].act = Sleeper(
        at=6, release=release, started=lambda n: started.setdefault("t", time.monotonic())
    )
    prof = hookprof.attach(model, **FAST)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    thread, seen = watch_page(prof, lambda f: samples(f, "hookprof_stall_info"), then=release.set)
    try:
        with caplog.at_level("WARNING", logger="hookprof"):
            for _ in range(8):
                x, y = model.batch(g)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        thread.join(20)
        families = seen["families"]
        (labels,) = samples(families, "hookprof_stall_info")
        assert dict(labels) == {
            "rank": "0",
            "step": "6",
            "phase": "forward",
            "layer": "blocks.2.act",
            "waiting_on": "code",
        }
        assert samples(families, "hookprof_stalled") == {frozenset({"rank": "0"}.items()): 1.0}
        assert samples(families, "hookprof_progress_phase") == {
            frozenset({"rank": "0", "phase": "forward"}.items()): 1.0
        }
        # judged after the threshold (0.3 s: the floor, a forward takes ~1 ms), not before
        assert seen["at"] - started["t"] >= 0.3
        # what `hookprof top` shows of that page, and print(prof.snapshot()) of that moment
        from hookprof.view.table import from_metrics, from_snapshot, header_lines, render

        (table,) = from_metrics(seen["text"])
        stall_line = "STALLED at step 6 in forward, innermost layer blocks.2.act, waiting on code"
        assert "  " + stall_line in header_lines([table.header])
        assert stall_line in render([from_snapshot(seen["snapshot"])])
        prof.flush()
        snap = prof.snapshot()
        assert snap.stall is None and snap.stalls == 1  # it went on
        assert samples(page(prof), "hookprof_stalled") == {frozenset({"rank": "0"}.items()): 0.0}
        block = next(
            r.getMessage() for r in caplog.records if "stalled in the forward" in r.getMessage()
        )
        assert "step 6" in block and "innermost layer: blocks.2.act" in block
        assert "stalling.py" in block and "in forward" in block  # the Sleeper's frame
    finally:
        release.set()
        prof.detach()


def test_a_stall_in_data_loading_is_phase_data():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **FAST)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # batch 6 (items 30..34 with batch_size 5) takes 3 s in the worker
    loader = torch.utils.data.DataLoader(
        SlowItems(60, slow_at=30, delay_s=3.0), batch_size=5, num_workers=1, prefetch_factor=1
    )
    thread, seen = watch_page(prof, lambda f: samples(f, "hookprof_stall_info"))
    try:
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        thread.join(20)
        (labels,) = samples(seen["families"], "hookprof_stall_info")
        assert dict(labels) == {
            "rank": "0",
            "step": "7",
            "phase": "data",
            "layer": "(unknown)",
            "waiting_on": "data",
        }
        assert (
            seen["snapshot"]
            .stall.stack[-1]
            .split(" in ")[-1]
            .startswith(("_try_get_data", "wait", "get", "_poll", "poll", "_recv", "select"))
        )
    finally:
        prof.detach()


def test_expect_slow_and_the_first_steps_never_stall(tmp_path):
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **QUIET)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    outside = {}
    try:
        for step in range(1, 9):
            x, y = model.batch(g)
            if step == 1:
                time.sleep(1.5)  # a first compile, say: warm-up learns, never judges
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == 5:
                with prof.expect_slow("checkpoint"):
                    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
                    time.sleep(1.5)  # a slow filesystem
                    outside = samples(page(prof), "hookprof_progress_phase")
        prof.flush()
        assert outside == {frozenset({"rank": "0", "phase": "outside"}.items()): -1.0}
        assert prof.snapshot().stalls == 0
        assert samples(page(prof), "hookprof_stalls", "hookprof_stalls_total") == {
            frozenset({"rank": "0"}.items()): 0.0
        }
    finally:
        prof.detach()


def test_without_stall_detection_no_thread_runs():
    before = {t.name for t in threading.enumerate()}
    prof = hookprof.attach(seeded(DeepNet), port=0, stall_detection=False)
    try:
        assert not any("stall-watch" in t.name for t in threading.enumerate())
    finally:
        prof.detach()
    prof = hookprof.attach(seeded(DeepNet), port=0)
    assert any("stall-watch" in t.name for t in threading.enumerate())
    prof.detach()
    time.sleep(0.1)
    assert {t.name for t in threading.enumerate() if "stall-watch" in t.name} <= before


def test_threshold_is_factor_times_the_median_within_floor_and_ceiling():
    """The watch's judgement on a clock of our own (no thread): learned per phase from the
    steps it saw, warm-up first, a stall reported once and cleared when the phase moves on."""
    from hookprof.faults import Faults
    from hookprof.phases.clock import BACKWARD, FORWARD, Progress
    from hookprof.phases.stall import StallWatch

    s = 1_000_000_000
    progress = Progress(0)
    watch = StallWatch(
        progress,
        seeded(DeepNet),
        factor=4.0,
        min_s=1.0,
        max_s=30.0,
        warmup_steps=3,
        faults=Faults(),
        rank=0,
        model_name="DeepNet",
        clock=lambda: 0,
    )
    now = 0
    forward_s = [2, 3, 10, 2, 3]  # median 3: a threshold of 12 s
    for number, fwd in enumerate(forward_s, 1):
        progress.enter(FORWARD, now)
        now += fwd * s
        progress.enter(BACKWARD, now)
        now += s // 10  # 0.1 s: 4 x 0.1 is under the 1 s floor
        progress.end_step(number, now)
        watch.check(now)  # one poll per step: every step is learned
    assert watch.threshold(FORWARD) == 12.0
    assert watch.threshold(BACKWARD) == 1.0  # the floor
    progress.enter(FORWARD, now)
    assert watch.check(now + 11 * s) is None
    report = watch.check(now + 13 * s)
    assert (
        report.step,
        report.phase,
        report.seconds,
        report.threshold_seconds,
        report.typical_seconds,
    ) == (6, "forward", 13.0, 12.0, 3.0)
    assert watch.check(now + 20 * s) is report and watch.stalls == 1  # once per stall
    progress.enter(BACKWARD, now + 21 * s)
    assert watch.check(now + 21 * s) is None and watch.stall is None
    # the ceiling: a phase whose typical duration is huge still stalls at stall_max_s
    for _ in range(40):
        _testing.typical_phase_seconds(watch, FORWARD).append(100.0)
    assert watch.threshold(FORWARD) == 30.0


def test_no_judgement_during_warm_up():
    from hookprof.faults import Faults
    from hookprof.phases.clock import FORWARD, Progress
    from hookprof.phases.stall import StallWatch

    progress = Progress(0)
    watch = StallWatch(
        progress,
        seeded(DeepNet),
        factor=2.0,
        min_s=1.0,
        max_s=30.0,
        warmup_steps=3,
        faults=Faults(),
        rank=0,
        model_name="DeepNet",
        clock=lambda: 0,
    )
    for number in (1, 2):
        progress.enter(FORWARD, number * 10**9)
        progress.end_step(number, number * 10**9 + 10**8)
        watch.check(number * 10**9 + 10**8)
    progress.enter(FORWARD, 3 * 10**9)  # step 3: only 2 steps completed
    assert watch.check(100 * 10**9) is None and watch.stalls == 0


def test_the_first_batch_of_an_epoch_is_judged_against_the_ceiling_only():
    """Workers starting (the first batch of each epoch) may take long: below stall_max_s it is
    no stall; a later batch as slow is one."""
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **{**QUIET, "stall_max_s": 10.0})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # item 0 (the first batch of every epoch) takes 2 s, twice the 1 s floor
    loader = torch.utils.data.DataLoader(
        SlowItems(20, slow_at=0, delay_s=2.0), batch_size=5, num_workers=1
    )
    try:
        for _ in range(3):
            for x, y in loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        prof.flush()
        assert prof.snapshot().step == 12 and prof.snapshot().stalls == 0
    finally:
        prof.detach()
