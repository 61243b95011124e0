"""Issue 12's table, row by row, on a real GPU: the NaN/Inf debugger with the host ahead of
the device. Marked cuda (skipped without CUDA; `python -m pytest -m cuda` runs them). Each
training loop runs under torch.cuda.set_sync_debug_mode("error"), so a host-device sync
that hookprof added raises (except row 2's, which reads the loss each step, and a GradScaler
over a non-fused optimizer, which syncs by itself); the CPU emulation of the same logic is
tests/unit/nonfinite/test_update_guard.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import hookprof
from support.compare import finite
from support.cuda import BAD_STEP, no_sync, setup
from support.inject import BadBatch
from support.settings import RARELY

pytestmark = pytest.mark.cuda


def run(
    model,
    opt,
    steps,
    bad: BadBatch | None,
    *,
    item_every_step=False,
    scaler=None,
    overflow_at=frozenset(),
):
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(32, 64, device=device, generator=g) for _ in range(steps)]
    ys = [torch.randn(32, 1, device=device, generator=g) for _ in range(steps)]
    torch.cuda.synchronize()
    # a GradScaler syncs by itself for an optimizer that cannot take its found-inf flag on the
    # device (non-fused: GradScaler._maybe_opt_step reads it with .item()), so such a loop
    # cannot run under the no-sync check without blaming hookprof for torch's own sync
    scaler_syncs = scaler is not None and not getattr(opt, "_step_supports_amp_scaling", False)
    mode = contextlib.nullcontext() if item_every_step or scaler_syncs else no_sync()
    with mode:
        for step, (x, y) in enumerate(zip(xs, ys), 1):
            if bad is not None and step == BAD_STEP:
                bad.poisoned = x
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
            else:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x), y)
                if step in overflow_at:
                    loss = (
                        loss * 6e4
                    )  # the fp16 gradients overflow down to a scale of ~1 (measured)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            if item_every_step:
                loss.item()


def test_row1_forward_nan_on_an_unsampled_step_is_named_under_skip_without_a_sync():
    model, opt = setup()
    bad = BadBatch(model, model.blocks[3][1])
    prof = hookprof.attach(model, **RARELY, on_nonfinite="skip")
    run(model, opt, 40, bad)
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    event = snap.first_nonfinite
    assert (event.layer, event.phase, event.step) == ("blocks.3.1", "forward", BAD_STEP)
    assert snap.held_back_updates == 1 and finite(model.parameters())


def test_row1_under_record_the_step_and_phase_are_exact():
    """Under "record" hookprof never changes training: the step's flag is not on the host
    before its update, so the NaN update lands; step and phase are exact, the layer is named
    only when the replay could run before the update (docs/nonfinite.md)."""
    model, opt = setup()
    bad = BadBatch(model, model.blocks[3][1])
    prof = hookprof.attach(model, **RARELY)
    run(model, opt, 30, bad)
    prof.flush()
    event = prof.snapshot().first_nonfinite
    prof.detach()
    assert (event.phase, event.step) == ("forward", BAD_STEP)


def test_row2_a_loop_that_reads_the_loss_every_step_gets_the_producer_under_record():
    model, opt = setup()
    bad = BadBatch(model, model.blocks[3][1])
    prof = hookprof.attach(model, **RARELY)
    run(model, opt, 30, bad, item_every_step=True)
    prof.flush()
    event = prof.snapshot().first_nonfinite
    prof.detach()
    assert (event.layer, event.phase, event.step) == ("blocks.3.1", "forward", BAD_STEP)


def test_row3_a_gradient_nan_is_named_with_its_step():
    model, opt = setup()
    bad = BadBatch(model, model.blocks[2][3], where="backward")
    prof = hookprof.attach(model, **RARELY)
    run(model, opt, 30, bad)
    prof.flush()
    event = prof.snapshot().first_nonfinite
    prof.detach()
    assert event.phase == "backward" and event.step == BAD_STEP
    assert event.layer.startswith("blocks.")


def test_row4_raise_stops_before_the_weights_are_hit():
    model, opt = setup()
    bad = BadBatch(model, model.blocks[3][1])
    prof = hookprof.attach(model, **RARELY, on_nonfinite="raise")
    try:
        with pytest.raises(hookprof.NonFiniteError) as info:
            run(model, opt, 60, bad)
    finally:
        prof.detach()
    assert info.value.step == BAD_STEP and info.value.layer == "blocks.3.1"
    assert finite(model.parameters())
    for state in opt.state.values():
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if torch.is_tensor(v))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_row5_6_gradscaler_skips_equal_the_scalers_count_and_are_no_incident(fused):
    model, opt = setup(fused)
    # 2**10 is far below the scale at which this model's fp16 gradients overflow by themselves
    # (measured with fp16 autocast on the CPU: from 2**24 down, the first 11 steps overflow and
    # the scaler settles at 8192), so the only skips are the forced ones; and 8 forced skips in
    # a row stay under max_skipped_steps (10), beyond which skips are an incident by design
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    counted = []
    original_update = scaler.update

    def update(*a, **k):  # the scaler's own count: its scale went down (read after the loop)
        counted.append(scaler._scale.clone())  # torch's: get_scale() would sync in the loop
        return original_update(*a, **k)

    scaler.update = update
    prof = hookprof.attach(model, **RARELY)
    run(model, opt, 30, None, scaler=scaler, overflow_at=frozenset(range(3, 11)))
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    scales = [float(s) for s in counted] + [scaler.get_scale()]
    own = sum(after < before for before, after in zip(scales, scales[1:]))
    assert own >= 8
    assert snap.skipped_steps == own
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}


def test_row7_flush_counts_a_nan_twenty_steps_later():
    model, opt = setup()
    bad = BadBatch(model, model.blocks[0][1])
    prof = hookprof.attach(model, **RARELY)
    run(model, opt, BAD_STEP + 20, bad)
    prof.flush()
    snap = prof.snapshot()
    prof.detach()
    assert snap.nonfinite_steps["forward"] >= 1
    assert snap.first_nonfinite.step == BAD_STEP
