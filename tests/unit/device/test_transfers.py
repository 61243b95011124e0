"""Only scalars leave the device, in one batched transfer per sampled step."""

from __future__ import annotations

import pytest

import hookprof
from hookprof.device import transfer
from support.models import MixedNet, seeded, train


@pytest.mark.parametrize("explicit_step", [False, True])
def test_one_transfer_per_sampled_step_none_otherwise(explicit_step):
    model = seeded(MixedNet)
    counts = []

    with hookprof.attach(model, port=0, sample_every=3, min_sample_interval_s=0.0) as prof:
        start = transfer.transfer_count()

        def note(step, m):
            counts.append(transfer.transfer_count() - start)

        train(model, 9, prof=prof, explicit_step=explicit_step, on_step=note)
        total = transfer.transfer_count() - start
        prof.flush()
        flushed = transfer.transfer_count() - start - total
        snap = prof.snapshot()
    assert snap.sampled_steps == 3  # steps 1, 4, 7
    assert total == 3
    assert flushed == 1  # flush() asked for the counters of steps 8-9: one copy, on request
    # a sampled step's transfer starts after it ends; nothing moves on the steps between
    assert counts == [0, 1, 1, 1, 2, 2, 2, 3, 3]
