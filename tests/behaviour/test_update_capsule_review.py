"""Review of the update's capsule (nonfinite/update_capsule.py, integrity/update_replay.py):
the gate's figures against the rule's, one capsule per jump, the pending comparisons at
flush() and detach()."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import hookprof
from hookprof.integrity import update_replay
from support.lagging_device import lagging_device
from support.updates import ARMED, AT, mlp, regression_steps

REPO = Path(__file__).resolve().parents[2]


def train(
    tmp_path: Path,
    *,
    steps: int,
    bumped=(),
    freeze=None,
    detach_only: bool = False,
    **config,
):
    """AdamW on a regression, the learning rate 40x on the steps `bumped`; hookprof attached
    with capsules in tmp_path. Returns (the snapshot after flush(), or None with
    `detach_only`; the profiler, detached; the capsules written)."""
    model = mlp()
    if freeze is not None:
        freeze(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    prof = hookprof.attach(model, **{**ARMED, "capsule_dir": str(tmp_path), **config})
    snap = None
    try:
        for step in range(1, steps + 1):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (40.0 if step in bumped else 1.0)
            x = torch.randn(32, 16, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :4]).backward()
            opt.step()
            prof.step()
        if not detach_only:
            prof.flush()
            snap = prof.snapshot()
    finally:
        prof.detach()
    return snap, prof, sorted(tmp_path.glob("hookprof-capsule-*.pt"))


def test_a_layer_with_a_frozen_parameter_writes_no_capsule_on_a_healthy_run(tmp_path):
    """Layer 2's weight frozen, its bias trained: the rule's ratio is the bias's update over
    the whole layer's weight (the frozen weight too); the gate must judge the same figure,
    not the bias's update over the bias alone (above the limit on every measured step)."""
    snap, _, capsules = train(
        tmp_path, steps=80, freeze=lambda m: m[2].weight.requires_grad_(False), capsule_max_count=20
    )
    assert snap.spikes["update_ratio_jump"].count == 0
    assert capsules == []


def test_one_jump_writes_one_capsule_while_its_event_goes_on(tmp_path):
    """The learning rate 40x for three steps: the rule counts one jump (the event goes on
    at the next two); one capsule, the jump's step's: the event's later steps are no jump
    and must not spend capsule_max_count's slots (the spike replay's capsules share them)."""
    snap, _, capsules = train(
        tmp_path,
        steps=AT + 6,
        bumped={AT, AT + 1, AT + 2},
        capsule_max_count=10,
        spike_replay=True,
    )
    jump = snap.spikes["update_ratio_jump"]
    assert (jump.count, jump.first.step) == (1, AT)
    update_capsules = [
        p for p in capsules if torch.load(p, weights_only=True)["view"].get("form") == "update"
    ]
    assert [p.name.split("-step")[1].split("-")[0] for p in update_capsules] == [str(AT)]


def test_flush_brings_the_pending_update_verdict(tmp_path):
    """On a device behind the host the jump's comparison waits for its values; flush()
    (which waits for the device) must bring it, as it did before capsules deferred it."""
    with lagging_device(lag=2):
        snap, _, capsules = train(tmp_path, steps=AT, bumped={AT})
    jump = snap.spikes["update_ratio_jump"].first
    assert jump is not None and jump.step == AT
    assert jump.verdict == "reproduced"
    assert len(capsules) == 1 and jump.capsule == str(capsules[0])


def test_detach_leaves_no_update_held(tmp_path):
    """The copies a pending comparison holds (parameters, gradients, optimizer state) are
    not kept past detach()."""
    with lagging_device(lag=2):
        _, prof, _ = train(tmp_path, steps=AT - 5, detach_only=True)
    replay = prof._events._update_replay
    assert replay is not None
    assert len(replay._pending) == 0


def test_a_late_comparison_finds_its_jump_after_a_later_one(tmp_path, monkeypatch):
    """Two jumps two steps apart on a device two measurements behind (emulated: a
    step's values reach the host at the end of the second step after it): the first's comparison is sent
    after the second's packet has been judged; it must still be matched to its own jump
    (the publisher looked only at the last jump's step)."""

    def behind(self):  # (a step's values reach the host two measured steps later)
        sent = []
        while len(self._pending) > 2:
            sent += self._decide(wait=False)
        return sent

    monkeypatch.setattr(update_replay.UpdateReplay, "poll", behind)
    snap, _, _ = train(tmp_path, steps=AT + 6, bumped={AT, AT + 2}, capsule_max_count=10)
    jumps = snap.spikes["update_ratio_jump"]
    assert (jumps.count, jumps.first.step, jumps.last.step) == (2, AT, AT + 2)
    assert jumps.first.verdict == "reproduced"
    assert jumps.last.verdict == "reproduced"


class LoopsOwn:
    """An object of the loop's own in a parameter group (its class not importable where the
    capsule is replayed)."""


@pytest.mark.parametrize("odd", [LoopsOwn, threading.Lock], ids=["own_class", "unpicklable"])
def test_a_groups_own_objects_leave_the_capsule_and_its_replay_alone(tmp_path, odd):
    """A key of the loop's own in the group (a name, a scheduler's note, a lock), which the
    update never reads: the capsule is written and replays (it had not been written at all,
    or replayed as 'could not load')."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["loops_own"] = odd()
    with hookprof.attach(model, **{**ARMED, "capsule_dir": str(tmp_path)}) as prof:
        regression_steps(model, opt, prof, AT + 1, lambda step, _: 40.0 if step == AT else 1.0)
        prof.flush()
        jump = prof.snapshot().spikes["update_ratio_jump"].first
    assert (jump.step, jump.verdict) == (AT, "reproduced")
    assert jump.capsule is not None
    # the update's own capsule (not the spike replay's of the batch, which the jump's step
    # gets too)
    assert torch.load(jump.capsule, weights_only=True)["view"]["form"] == "update"
    done = subprocess.run(
        [sys.executable, "-m", "hookprof.cli", "replay", jump.capsule, "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_jump_held_for_three_steps_writes_the_updates_capsule_alone(tmp_path):
    """The jump's gate replays the step's forward and backward too; the spike replay wrote
    its batch's capsule on every measured step above the rule's limit while the jump lasted
    (it cannot tell a jump's first step from the next measurement of one going on: a second
    review's finding). None now: the update's capsule holds the gradients. The loss and
    norm rules out of reach, so that only the jump's gate speaks."""
    snap, _, capsules = train(
        tmp_path,
        steps=AT + 6,
        bumped={AT, AT + 1, AT + 2},
        capsule_max_count=10,
        loss_spike_z=1e9,
        grad_norm_spike_z=1e9,
    )
    assert snap.spikes["update_ratio_jump"].count == 1
    forms = [torch.load(p, weights_only=True)["view"]["form"] for p in capsules]
    assert forms == ["update"]
