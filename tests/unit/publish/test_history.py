"""The report's history (hookprof/publish/history.py): fixed memory however long the run, merged
points that agree with the raw steps they cover, per-layer series bounded.

Fed the way the publisher feeds it: real packets (pack_step) folded by a real Aggregator,
StepCounters counting every step, then History.observe."""

from __future__ import annotations

import math
import tracemalloc

import pytest
import torch

from hookprof.device.timing import CpuTimer
from hookprof.publish.aggregate import Aggregator
from hookprof.publish.history import RERANK_POINTS, History
from hookprof.step.record import StepCounters, pack_step


def step_seconds(step: int) -> float:
    return 0.01 + 0.001 * (step % 7)


def loss_at(step: int) -> float:
    return 1.0 / (1 + step % 13)


def grad_at(step: int, layer: int) -> float:
    return 0.5 + 0.01 * ((step * (layer + 1)) % 17)


class Feed:
    """A run of `n_layers` layers: every step counted, one in `every` sampled and folded."""

    def __init__(self, n_layers: int, history: History, every: int = 1, loss=loss_at):
        self.names = [f"layer{i}" for i in range(n_layers)]
        self.aggregator = Aggregator(self.names, ["Linear"] * n_layers, rank=0, max_layers=500)
        self.counters = StepCounters()
        self.history = history
        self.timer = CpuTimer()
        self.every = every
        self.loss = loss
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            self.counters.observe(step_seconds(self.step), float(self.step))
            if self.step % self.every:
                continue
            squares = torch.tensor(
                [grad_at(self.step, i) ** 2 for i in range(len(self.names))], dtype=torch.float64
            )
            packet = pack_step(
                self.step,
                None,
                [],
                loss=self.loss(self.step),
                grad_squares=([squares], frozenset(range(len(self.names)))),
            )
            self.aggregator.fold(packet, self.timer)
            self.history.observe(packet, self.aggregator, self.counters)


def test_a_million_steps_keep_the_history_at_its_fixed_size():
    history = History([f"layer{i}" for i in range(4)], max_points=256)
    feed = Feed(4, history, every=50)  # 1e6 steps, 20,000 of them sampled
    feed.run(100 * 256)  # 512 sampled steps: the history is full and has been halved once
    full = history.nbytes()
    sizes = []
    for _ in range(7):
        feed.run(100_000)
        sizes.append(history.nbytes())
    # the Python objects the history holds do not grow either (traced over the last stretch)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        feed.run(1_000_000 - feed.step)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sizes.append(history.nbytes())
    assert feed.step == 1_000_000
    view = history.view()
    assert len(view["points"]["step"]) <= 256
    assert max(sizes) <= full * 2, (
        full,
        sizes,
    )  # arrays over-allocate a little; never grow with the run
    assert after - before < 64 * 1024, after - before
    assert history.stride * 256 >= feed.step // 50 > history.stride * 128
    assert view["points"]["step"][-1] == 1_000_000  # the last point ends at the last sampled step
    assert sum(view["points"]["samples"]) == 20_000
    assert sum(view["points"]["steps"]) == 1_000_000  # every step covered exactly once
    print(
        f"history of 1e6 steps (20,000 sampled, 4 layers): {history.nbytes()} bytes of series, "
        f"{len(view['points']['step'])} points of {history.stride} sampled steps"
    )


def test_merged_points_agree_with_the_raw_steps_they_cover():
    history = History(["a", "b", "c"], max_points=8)
    feed = Feed(3, history, every=1)
    feed.run(100)
    view = history.view()
    pts = view["points"]
    assert history.stride == 16  # 100 points halved until they fit in 8: 16 each
    assert len(pts["step"]) == 7  # six full points, the last one open (4 steps)
    for k, last in enumerate(pts["step"]):
        covered = range(k * 16 + 1, int(last) + 1)
        assert last == min((k + 1) * 16, 100)
        assert pts["samples"][k] == len(covered)
        assert math.isclose(
            pts["step_seconds"][k], sum(map(step_seconds, covered)) / len(covered), rel_tol=1e-12
        )
        assert math.isclose(
            pts["loss"][k], sum(map(loss_at, covered)) / len(covered), rel_tol=1e-12
        )
        global_norm = max(math.sqrt(sum(grad_at(s, i) ** 2 for i in range(3))) for s in covered)
        assert math.isclose(pts["grad_norm"][k], global_norm, rel_tol=1e-9)
        for i, row in enumerate(view["layers"]):
            assert row["name"] == "abc"[i]
            assert math.isclose(
                row["grad_norm"][k], max(grad_at(s, i) for s in covered), rel_tol=1e-9
            )


def test_a_non_finite_value_survives_merging():
    bad_step = 11
    history = History(["a"], max_points=4)
    feed = Feed(1, history, loss=lambda step: math.nan if step == bad_step else loss_at(step))
    feed.run(40)
    pts = history.view()["points"]
    bad = [k for k, v in enumerate(pts["loss"]) if v is not None and math.isinf(v)]
    (k,) = bad  # exactly the point covering step 11, however many merges later
    assert pts["step"][k] - pts["samples"][k] < bad_step <= pts["step"][k]


def test_per_layer_series_are_bounded_and_follow_the_busiest_and_the_bad_layers():
    names = [f"layer{i}" for i in range(100)]
    history = History(names, max_points=64, layer_slots=8)
    feed = Feed(100, history)
    # layer i's time grows with i: the eight busiest are 92..99
    feed.aggregator.fwd_total[:] = [float(i) for i in range(100)]
    feed.run(5)
    tracked = [row["name"] for row in history.view()["layers"]]
    assert sorted(tracked) == sorted(names[92:])
    # layer3's output went non-finite on a sampled step (what Aggregator.fold counts): it takes
    # the least busy slot when the layers are ranked again, every RERANK_POINTS points
    feed.aggregator.fwd_nonfinite[3] = 1
    feed.run(RERANK_POINTS)
    view = history.view()
    tracked = [row["name"] for row in view["layers"]]
    assert len(tracked) == 8 and "layer3" in tracked and "layer92" not in tracked
    row = view["layers"][tracked.index("layer3")]
    ranked_at = RERANK_POINTS + 1  # the point at which it was ranked again
    assert row["grad_norm"][: ranked_at - 1] == [None] * (
        ranked_at - 1
    )  # nothing from before its slot
    for step in range(ranked_at, 5 + RERANK_POINTS + 1):
        assert math.isclose(row["grad_norm"][step - 1], grad_at(step, 3), rel_tol=1e-9)


def test_a_publisher_behind_the_training_thread_keeps_each_points_own_step_time():
    """Under load the publisher folds a sampled step after the next ones have ended: the
    point's step time is that of the steps it covers as they ended (the packet says), not
    what the live counters hold by then (before: one point took both steps' time, the next
    none, and the report's chart broke on the missing value)."""
    names = ["layer0", "layer1"]
    aggregator = Aggregator(names, ["Linear"] * 2, rank=0, max_layers=500)
    counters, history, timer = StepCounters(), History(names), CpuTimer()
    packets = []
    for step in range(1, 7):
        counters.observe(step_seconds(step), float(step))
        squares = torch.tensor([grad_at(step, i) ** 2 for i in range(2)], dtype=torch.float64)
        packet = pack_step(step, None, [], grad_squares=([squares], frozenset(range(2))))
        packet.steps_at_end = counters.totals()
        packets.append(packet)
    for packet in packets:  # folded only now, all six steps counted already
        aggregator.fold(packet, timer)
        history.observe(packet, aggregator, counters)
    seconds = history.view()["points"]["step_seconds"]
    assert seconds == [pytest.approx(step_seconds(s)) for s in range(1, 7)]
