"""`on_nonfinite="skip"` holds back every optimizer that updates the model (issue 38, item 4).

A model trained by two optimizers (an encoder's and a decoder's, two learning rates) and no
`prof.step()`: the first optimizer's post-hook ends the step, so the second one's update came
after the step had ended, was never judged, and took the NaN into its layers and its Adam
state. It failed before: the decoder's weights went NaN at the bad step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from support.compare import finite, same_bits
from support.settings import RARELY

BAD_STEP = 4


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.decoder = nn.Linear(16, 1)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def train(
    policy: str | None, *, skip: frozenset = frozenset(), fused: bool = False, steps: int = 7
):
    """Two Adam optimizers; a batch with an Inf at BAD_STEP (it makes every gradient NaN).
    `skip`: the reference leaves those steps' updates out itself."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    opts = [
        torch.optim.Adam(model.encoder.parameters(), lr=1e-2, fused=fused),
        torch.optim.Adam(model.decoder.parameters(), lr=1e-3, fused=fused),
    ]
    g = torch.Generator().manual_seed(1)
    prof = (
        None
        if policy is None
        else hookprof.attach(model, **RARELY, on_nonfinite=policy, summary_at_exit=False)
    )
    try:
        for step in range(1, steps + 1):
            x = torch.randn(4, 8, generator=g)
            if step == BAD_STEP:
                x[0, 0] = float("inf")
            for opt in opts:
                opt.zero_grad()
            model(x).square().mean().backward()
            if step in skip:
                continue
            for opt in opts:
                opt.step()
        snap = None
        if prof is not None:
            prof.flush()
            snap = prof.snapshot()
        return model, opts, snap
    finally:
        if prof is not None:
            prof.detach()


@pytest.mark.parametrize("fused", [False, True], ids=["for-each Adam", "fused Adam"])
def test_skip_holds_back_every_optimizer_of_the_bad_step(fused):
    reference, _, _ = train(None, skip=frozenset({BAD_STEP}), fused=fused)
    model, opts, snap = train("skip", fused=fused)
    assert finite(list(model.parameters()))
    for opt in opts:  # the optimizers' state too: no NaN reached Adam's moments
        assert finite(
            [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
        )
    assert same_bits(list(model.parameters()), list(reference.parameters()))
    assert snap.held_back_updates == 1  # one step held back, however many optimizers it had
    assert (snap.first_nonfinite.phase, snap.first_nonfinite.step) == ("forward", BAD_STEP)
    assert snap.step == 7


def test_on_a_device_behind_the_host_both_fused_updates_skip_on_the_device():
    """The same on an emulated device three steps behind the host: the step's flag is still
    on the device, so both fused optimizers get it as found_inf, and neither waits."""
    from support.lagging_device import lagging_device

    reference, _, _ = train(None, skip=frozenset({BAD_STEP}), fused=True)
    with lagging_device(3) as device:
        model, opts, snap = train("skip", fused=True)
    assert "MainThread" not in device.waits
    assert finite(list(model.parameters()))
    assert same_bits(list(model.parameters()), list(reference.parameters()))
    assert all(not hasattr(opt, "found_inf") for opt in opts)
