"""DESIGN.md invariant 9 (issue 28): the first NaN's attribution depends only on what was
observed, never on the order in which records, replays and counter drains reach the
publisher.

The packets are real: each scenario of support.first_nan trains with a Publisher subclass
that keeps every packet the training thread submits (sampled steps, replayed forwards,
counter drains, "not replayed" notes), on the CPU and on the emulated device 1 and 3 steps
behind the host, under on_nonfinite "record" and "skip" (a fused SGD, whose non-finite
update skip holds back on the device). After flush(), the same packets are folded into fresh
Aggregators in many orders: every permutation of the packets from the incident's step on
when there are few, else a few hundred seeded ones, plus the reversed order; the packets
before the incident stay in order ahead of them. Every order must give one answer
(layer, phase, step, found_by, replay), the one the scenario says independently."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from hookprof.publish.aggregate import Aggregator
from hookprof.publish.publisher import Publisher
from hookprof.step.record import StepCounters
from support.first_nan import LAGS, SCENARIOS, Overflow, event_key, run

POLICIES = ("record", "skip")
MAX_ORDERS = 200  # seeded random orders when the tail has too many packets for all of them
ALL_PERMUTATIONS_UP_TO = 6  # packets in the tail: 6! = 720 orders


def capturing_publisher():
    """(a Publisher subclass for hookprof.Profiler, the list it fills with every packet
    submitted, in submission order)."""
    packets = []

    class SpyPublisher(Publisher):
        def submit(self, packet):
            packets.append(packet)
            super().submit(packet)

    return SpyPublisher, packets


def captured(name: str, lag: int, policy: str):
    scenario = SCENARIOS[name]()
    spy, packets = capturing_publisher()
    result = run(scenario, lag=lag, policy=policy, steps=scenario.steps(lag), publisher=spy)
    return scenario, result, packets


def fold(result, packets):
    """The first NaN/Inf a fresh Aggregator of the run's model says after `packets`."""
    prof = result.prof
    agg = Aggregator.for_table(
        prof.table, prof.rank, prof.config, efficiency=None, device_phases=None
    )
    for packet in packets:
        agg.fold(packet, prof.timer)
    return agg.snapshot(StepCounters(), 0).first_nonfinite


def orders(packets, at: int, seed: int):
    """The packets before the incident in order, then the rest in every order (few) or in
    MAX_ORDERS seeded random orders, the reversed one and the submitted one among them."""
    split = next((i for i, p in enumerate(packets) if p.step >= at), len(packets))
    head, tail = packets[:split], packets[split:]
    if len(tail) <= ALL_PERMUTATIONS_UP_TO:
        tails = [list(t) for t in itertools.permutations(tail)]
    else:
        rng = random.Random(seed)
        tails = [tail, tail[::-1]]
        for _ in range(MAX_ORDERS):
            shuffled = list(tail)
            rng.shuffle(shuffled)
            tails.append(shuffled)
    for t in tails:
        yield head + t
    yield packets[::-1]  # the fully reversed order, the earliest packets last too


def describe(packet) -> str:
    kind = (
        "sampled"
        if packet.sampled
        else "replay"
        if packet.record is not None
        else "not replayed"
        if packet.not_replayed
        else "drain"
    )
    return f"{kind}@{packet.step}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_order_of_the_packets_gives_the_one_expected_answer(name, lag, policy):
    scenario, result, packets = captured(name, lag, policy)
    expected = scenario.expected(lag, policy)
    live = result.snapshot.first_nonfinite
    kinds = Counter(describe(p).split("@")[0] for p in packets if p.step >= scenario.at)
    answers: Counter = Counter()
    notes: set = set()
    wrong = None
    for order in orders(packets, scenario.at, seed=sum(map(ord, f"{name}{lag}{policy}"))):
        event = fold(result, order)
        answers[event_key(event)] += 1
        notes.add(event.replay_note if event is not None else None)
        if event_key(event) != expected.key and wrong is None:
            wrong = [describe(p) for p in order]
    said = (
        f"the run said {event_key(live)}; over {sum(answers.values())} orders of "
        f"{len(packets)} packets ({dict(kinds)} from step {scenario.at} on): {dict(answers)}; "
        f"expected {expected.key}; a wrong order: {wrong}"
    )
    assert event_key(live) == expected.key and set(answers) == {expected.key}, said
    assert live.replay_note == expected.replay_note and notes == {expected.replay_note}, notes


def test_a_packets_batch_reads_the_same_twice():
    """Folding one run's packets into several aggregators reads each packet's HostBatch
    again: the values (and so the answer) are the same each time."""
    scenario, result, packets = captured("overflow", 3, "skip")
    batches = [p.batch for p in packets if p.batch is not None]
    assert batches
    keys_of = [("counters", 0), "act_max", "act_min", "weights_bad"]
    first = [[b.get(k) for k in keys_of] for b in batches]
    second = [[b.get(k) for k in keys_of] for b in batches]
    assert repr(first) == repr(second)  # repr: NaNs compare equal
    assert (
        event_key(fold(result, packets))
        == event_key(fold(result, packets))
        == scenario.expected(3, "skip").key
    )


@pytest.mark.parametrize("lag", LAGS)
def test_the_drain_folded_before_the_replays_record_and_after_it(lag):
    """The gap the last session left: no test folded the counters' drain (which says which
    step was first) before the replay's record of that step. Here both ways, explicitly: on
    the CPU the replay's record is submitted before any drain that knows of the NaN."""
    scenario = Overflow()
    spy, packets = capturing_publisher()
    result = run(scenario, lag=lag, policy="skip", steps=scenario.steps(lag), publisher=spy)
    expected = scenario.expected(lag, "skip").key
    replays = [p for p in packets if not p.sampled and p.record is not None]
    assert [p.step for p in replays] == [scenario.at]
    replay = replays[0]
    others = [p for p in packets if p is not replay]
    drains = [p for p in others if p.counter_parts and p.record is None]
    assert drains

    # drains (every one: the ones that know of the NaN included) first, then the record
    before = fold(result, others)
    assert before is not None and (before.layer, before.phase, before.step) == (
        None,
        "forward",
        scenario.at,
    )
    assert event_key(fold(result, others + [replay])) == expected
    rest = [p for p in others if all(p is not d for d in drains)]
    assert event_key(fold(result, drains + [replay] + rest)) == expected
    # the record first: on the CPU it is submitted before any counter says step 5 went bad
    # (it alone places nothing); behind the host, a late replay's packet may carry them
    alone = fold(result, [replay])
    if lag == 0:
        assert alone is None
    assert alone is None or event_key(alone) == expected
    assert event_key(fold(result, [replay] + others)) == expected
