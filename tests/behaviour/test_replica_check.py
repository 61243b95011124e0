"""Issue 43 item 4, in one process: the replica check's fingerprint is the parameters' after
the check step's update (against the test's own computation of them at every step), its
steps are the multiples of a power of two of steps lasting the interval, and a fault in it
costs the check alone (counted under "integrity"; training and every other figure go on).
Across real ranks: tests/system/test_replica_check_ranks.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hookprof
import hookprof.integrity.replicas as replicas
from hookprof.integrity.replicas import ReplicaCheck
from support.fingerprints import numpy_fingerprint
from support.metrics import errors_by_part, parse, scrape


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 1))


def train(prof, model, steps: int, after_step=None, pause_s: float = 0.002) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        prof.step()
        if after_step is not None:
            after_step()
        time.sleep(pause_s)  # a step of a few ms: checks every few steps at a 10 ms interval


def test_the_fingerprint_is_the_parameters_after_the_check_steps_update():
    model = small_model()
    after: dict[int, int] = {}  # step -> the test's own fingerprint of the parameters then
    with hookprof.attach(model, port=0, sdc_check_interval_s=0.01) as prof:
        train(
            prof,
            model,
            60,
            after_step=lambda: after.__setitem__(
                len(after) + 1, numpy_fingerprint(list(model.parameters()))
            ),
        )
        prof.flush()
        snap = prof.snapshot()
        text = scrape(prof.url)
    fp = snap.parameter_fingerprint
    assert fp is not None and fp.step % prof._replicas.period == 0 and fp.step > 1
    assert fp.value == after[fp.step]
    assert fp.value != after[fp.step - 1]  # (Adam moved every weight in between)
    page = parse(text)
    [(labels, value)] = [
        (dict(s.labels), s.value) for s in page["hookprof_parameter_fingerprint"].samples
    ]
    assert value == fp.value and labels["replica_group"] == fp.replica_group
    [step] = [s.value for s in page["hookprof_parameter_fingerprint_step"].samples]
    assert step == fp.step


def test_check_steps_are_multiples_of_a_power_of_two_lasting_the_interval():
    check = ReplicaCheck(nn.Linear(2, 2), 1.0, "run:test")
    step_ns = 30_000_000  # 30 ms steps: 1 s is 33.3 steps, so every 64th step
    due = [n for n in range(1, 400) if check.due(n, n * step_ns)]
    assert due == [64, 128, 192, 256, 320, 384]
    # a rank whose steps seem 3% longer agrees (the same power of two); one whose steps
    # seem 10% longer takes every 32nd step, and still checks every step the first one does
    near = ReplicaCheck(nn.Linear(2, 2), 1.0, "run:test")
    assert [n for n in range(1, 400) if near.due(n, int(n * step_ns * 1.03))] == due
    far = ReplicaCheck(nn.Linear(2, 2), 1.0, "run:test")
    far_due = [n for n in range(1, 400) if far.due(n, int(n * step_ns * 1.1))]
    assert far_due == list(range(32, 400, 32)) and set(due) <= set(far_due)


def test_a_fault_in_the_check_costs_the_check_alone(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected into the fingerprint")

    monkeypatch.setattr(replicas, "device_fingerprints", broken)
    model = small_model()
    with hookprof.attach(model, port=0, sdc_check_interval_s=0.01, sample_every=1) as prof:
        train(prof, model, 40)
        prof.flush()
        snap = prof.snapshot()
        page = parse(scrape(prof.url))
    assert snap.step == 40 and snap.parameter_fingerprint is None
    assert "hookprof_parameter_fingerprint" not in page
    errors = errors_by_part(page)
    assert errors["integrity"] >= 1
    assert {part: n for part, n in errors.items() if part != "integrity"} == dict.fromkeys(
        (p for p in errors if p != "integrity"), 0.0
    )
    assert snap.layers["0"].forward_calls_total > 0  # the sampled steps' figures went on


def test_off_by_default():
    model = small_model()
    with hookprof.attach(model, port=0) as prof:
        train(prof, model, 5)
        prof.flush()
        assert prof.snapshot().parameter_fingerprint is None
        assert "hookprof_parameter_fingerprint" not in parse(scrape(prof.url))


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_a_bad_interval_is_named(bad):
    with pytest.raises(hookprof.ConfigError, match="sdc_check_interval_s"):
        hookprof.attach(small_model(), port=0, sdc_check_interval_s=bad)


def test_parameters_replaced_after_attach_are_the_ones_checked():
    """A checkpoint loaded with load_state_dict(assign=True) replaces the parameter objects:
    the check reads the model's parameters at each check, so it follows them, and a bit
    flipped in a live weight changes the fingerprint."""
    model = small_model()
    with hookprof.attach(model, port=0, sdc_check_interval_s=0.01) as prof:
        train(prof, model, 15)
        state = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
        fresh = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay put

        def steps(n: int) -> None:
            for _ in range(n):
                fresh.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                fresh.step()
                prof.step()
                time.sleep(0.002)

        steps(15)
        prof.flush()
        loaded = prof.snapshot().parameter_fingerprint
        assert loaded.value == numpy_fingerprint(list(model.parameters()))
        with torch.no_grad():
            model[0].weight.view(torch.int32)[0, 0] ^= 1 << 20
        steps(15)
        prof.flush()
        flipped = prof.snapshot().parameter_fingerprint
    assert flipped.step > loaded.step and flipped.value != loaded.value
    assert flipped.value == numpy_fingerprint(list(model.parameters()))


def test_it_says_where_replicas_differ_by_design(monkeypatch):
    """Sharded parameters, or skip/raise on one rank of several (a hold decided per rank):
    said once at attach, with the reason."""
    said: list[tuple[str, str]] = []

    def check(sharded: bool, **config):
        cfg = hookprof.Config(sdc_check_interval_s=60.0, **config)
        return ReplicaCheck.for_model(nn.Linear(2, 2), cfg, sharded, lambda k, t: said.append(t))

    assert check(False) is not None and said == []
    check(True)
    assert "shard" in said[-1]
    monkeypatch.setattr(replicas, "with_other_ranks", lambda: True)
    check(False, on_nonfinite="skip")
    assert "held back on one rank alone" in said[-1]
    assert ReplicaCheck.for_model(nn.Linear(2, 2), hookprof.Config(), False, print) is None
