"""The forward replay never changes what training sees (issue 38, item 3).

A forward that edits its input in place (`x /= 2`, common in normalising code) ran again on
the step's own input bumped the version counter of a tensor autograd had saved, and the
user's `loss.backward()` raised "modified by an inplace operation" (without hookprof every
step ran); with the first layer frozen training went on, but the replay, on an input divided
twice, read "transient" for a reproducible NaN. The replay now runs on copies of the inputs,
and a step whose inputs were edited in place after its forward began is not replayed, with
that reason. Each test here failed before (the input patterns raised in backward).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.nonfinite.replay import INPUTS_CHANGED
from hookprof.snapshot import ReplayOutcome
from support.compare import same_bits
from support.settings import RARELY

BAD_STEP = 4  # unsampled (RARELY samples step 1 only): the replay is what names a producer

EDITS = {
    "x /= 2": lambda x: x.div_(2),
    "x.add_(1)": lambda x: x.add_(1.0),
    "x.relu_()": lambda x: x.relu_(),
    "a buffer += 1": None,  # the forward updates a buffer of its own instead
}


class Exp(nn.Module):
    def forward(self, x):
        return x.exp()  # overflows to inf past ~88: a data-dependent producer


class Normalising(nn.Module):
    """Edits its input in place (or a buffer), then a Linear that saves that input for its
    weight's gradient, then a layer that overflows on a large batch."""

    def __init__(self, edit: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.exp = Exp()
        self.head = nn.Linear(8, 1)
        self.register_buffer("calls", torch.zeros(()))
        self._edit = EDITS[edit]

    def forward(self, x):
        if self._edit is None:
            self.calls += 1
        else:
            self._edit(x)
        return self.head(self.exp(self.fc(x)))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(4, 8, generator=g) for _ in range(6)]
    out[BAD_STEP - 1] = torch.full((4, 8), 1000.0)  # fc's output past exp's range
    return out


def train(edit: str, *, frozen: bool, prof_settings: dict | None):
    torch.manual_seed(0)
    model = Normalising(edit)
    if frozen:
        model.fc.requires_grad_(False)  # its input is then not saved: training survives either way
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    prof = hookprof.attach(model, **prof_settings) if prof_settings is not None else None
    losses = []
    try:
        for x in batches():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if prof is not None:
            prof.flush()
            return model, losses, prof.snapshot()
        return model, losses, None
    finally:
        if prof is not None:
            prof.detach()


@pytest.mark.parametrize("frozen", [False, True], ids=["trained first layer", "frozen first layer"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_the_replay_leaves_training_as_it_was_and_says_why_it_did_not_run(edit, frozen):
    reference, ref_losses, _ = train(edit, frozen=frozen, prof_settings=None)
    model, losses, snap = train(
        edit, frozen=frozen, prof_settings=dict(RARELY, summary_at_exit=False)
    )
    # every step ran, and training is what it was without hookprof, bit for bit
    assert len(losses) == len(ref_losses) == 6
    assert same_bits(losses, ref_losses)
    assert same_bits(list(model.parameters()), list(reference.parameters()))
    assert same_bits([model.calls], [reference.calls])  # the replay's buffer writes went to copies
    event = snap.first_nonfinite
    assert (event.phase, event.step) == ("forward", BAD_STEP)
    if EDITS[edit] is None:  # the inputs are the step's: the replay names the producer
        assert (event.layer, event.replay) == ("exp", ReplayOutcome.REPRODUCIBLE)
    else:  # never "transient": the replay would have run on an input edited twice
        assert (event.layer, event.replay, event.replay_note) == (
            None,
            ReplayOutcome.NOT_REPLAYED,
            INPUTS_CHANGED,
        )


def test_the_replay_runs_on_copies_of_the_inputs():
    """An input the forward does not edit is replayed, on a copy: the step's tensor keeps its
    version counter (autograd compares it in backward) and its values."""
    seen = []

    class Watch(nn.Module):
        def forward(self, x):
            if x.device.type != "meta":  # (sampled steps count FLOPs on meta copies)
                seen.append(x)
            return x

    torch.manual_seed(0)
    model = nn.Sequential(Watch(), nn.Linear(8, 8), Exp(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookprof.attach(model, **RARELY, summary_at_exit=False) as prof:
        for x in batches():
            opt.zero_grad()
            version = x._version
            model(x).square().mean().backward()
            opt.step()
            assert x._version == version
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert (event.layer, event.step, event.replay) == ("2", BAD_STEP, ReplayOutcome.REPRODUCIBLE)
    replayed = seen[BAD_STEP]  # the call after the bad step's own: the replay's
    assert replayed is not seen[BAD_STEP - 1] and torch.equal(replayed, seen[BAD_STEP - 1])
