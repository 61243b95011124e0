"""Only scalars leave the device, in one batched transfer per sampled step."""

from __future__ import annotations

import pytest
import torch

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


def test_a_batch_keeps_counts_exact_beside_low_precision_values():
    """The one copy is float64 whatever its parts: a bfloat16 part beside int64 counts
    promoted the whole copy to bfloat16 before, and a count of 4095 arrived as 4096."""
    batch = transfer.ScalarBatch()
    batch.add("low", torch.tensor([1.5, -3.0], dtype=torch.bfloat16))
    batch.add("counts", torch.tensor([4095, 2**40 + 1], dtype=torch.int64))
    batch.add("flag", torch.tensor(True))
    sent = batch.send()
    assert sent.get("low") == [1.5, -3.0]
    assert sent.get("counts") == [4095.0, float(2**40 + 1)]
    assert sent.get("flag") == [1.0]
