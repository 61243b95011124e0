"""Issue 43 items 2-3 for update ratio jumps: the forward and backward of a jump's step too.

An update is made from the step's gradients: a jump whose update the optimizer makes again
bit for bit may still come from a gradient the device computed wrongly. So a measured step
whose layer's update ratio passes the jump's gate (half the rule's threshold and margin,
integrity/update_replay.py `_gate_step`) has its forward and backward replayed as a loss or
gradient-norm spike's step is, and the jump's verdict is the replay's when it differed,
first in the order the step computed them. Here the loss and norm rules are set out of reach
(z 1e9), so only the jump's own gate can replay a step. A weight gradient the test makes
wrong on one step (fc2's, 100x, in its backward only) makes SGD's update jump: the update
reproduces, the backward does not, and fc2.weight's gradient is named. A learning rate 40x
too large is reproduced forward, backward and update. Checked against the test's own spy on
the publisher's verdicts."""

from __future__ import annotations

import pytest
import torch

import hookprof
from hookprof.integrity import spike_replay
from support.updates import ARMED, AT, STEPS
from support.wrong_gradients import WeightFaultNet, _WrongWeightGradient

# only the jump's gate can replay a step: the loss's and the norm's rules out of reach
JUMPS_ONLY = {**ARMED, "loss_spike_z": 1e9, "grad_norm_spike_z": 1e9}


@pytest.fixture
def replayed(monkeypatch):
    """The forward-and-backward replays the publisher judged, by step: (comparison, flags)."""
    seen: dict[int, tuple[spike_replay.SpikeComparison, list[float]]] = {}
    real = spike_replay.SpikeReplays.judge

    def judge(self, comparison, flags, verdicts=None):
        if comparison.update_from is None:
            seen[comparison.step] = (comparison, list(flags))
        return real(self, comparison, flags, verdicts)

    monkeypatch.setattr(spike_replay.SpikeReplays, "judge", judge)
    return seen


def train(*, wrong_at=None, bump=1.0):
    torch.manual_seed(0)
    model = WeightFaultNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(model, **JUMPS_ONLY) as prof:
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (bump if step == AT else 1.0)
            x = torch.randn(32, 8, generator=g)
            y = x[:, :1].clone()
            opt.zero_grad()
            _WrongWeightGradient.armed["now"] = step == wrong_at
            (model(x) - y).square().mean().backward()
            opt.step()
            prof.step()
        prof.flush()
        return prof.snapshot()


def test_a_wrong_weight_gradient_that_only_jumps_the_update_is_named(replayed):
    snap = train(wrong_at=AT)
    jump = snap.spikes["update_ratio_jump"]
    assert (jump.count, jump.first.step, jump.first.layer) == (1, AT, "fc2")
    # the loss and norm rules said nothing: the jump's gate alone replayed the step
    assert snap.spikes["loss_spike"].count == snap.spikes["grad_norm_spike"].count == 0
    comparison, flags = replayed[AT]
    assert comparison.refused is None
    differing = [name for name, flag in zip(comparison.layers, flags) if flag]
    assert differing and differing[0] == "fc2.weight"
    assert jump.first.verdict == "not_reproduced"
    assert (jump.first.entered, jump.first.entered_phase) == ("fc2.weight", "parameter_gradient")


def test_a_jump_the_learning_rate_made_is_reproduced_forward_backward_and_update(replayed):
    snap = train(bump=40.0)
    jump = snap.spikes["update_ratio_jump"].first
    assert (jump.step, jump.verdict, jump.entered) == (AT, "reproduced", None)
    comparison, flags = replayed[AT]
    assert comparison.refused is None and comparison.params_from is not None
    assert not any(flags)
    # a healthy step's ratios stay under the gate: none of them replayed (the calibration's
    # few healthy replays aside, which the publisher does not judge)
    assert sorted(replayed) == [AT]
