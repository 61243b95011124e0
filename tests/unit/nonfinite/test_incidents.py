"""Every-step NaN/Inf detection, the first offender, the policies, and GradScaler skips."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

import hookprof
from hookprof import NonFiniteEvent
from hookprof.device import transfer
from support.inject import StepInjector
from support.models import DeepNet, loss_of, scaler_loop, seeded
from support.settings import RARELY
from support.waiting import wait_for


def run(model, steps, prof=None, injector=None, poison=None, loss_override=None):
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(1, steps + 1):
        if injector is not None:
            injector.step = step
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, model.batch(g))
        loss.backward()
        if poison is not None:
            poison(step, model)
        opt.step()
        if prof is not None:
            prof.step(loss_override(step, loss) if loss_override else loss)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_forward_nan_on_an_unsampled_step_is_localised_exactly(value):
    reference = seeded(DeepNet)
    ref_injector = StepInjector(reference.blocks[2].fc, {7}, value)
    run(reference, 10, injector=ref_injector)

    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[2].fc, {7}, value)
    prof = hookprof.attach(model, **RARELY)
    run(model, 10, prof=prof, injector=injector)
    prof.detach()
    snap = prof.snapshot()

    order = model.order()
    after = tuple(order[order.index("blocks.2.fc") + 1 :])
    assert snap.first_nonfinite == NonFiniteEvent(
        "blocks.2.fc", "forward", 7, after, found_by="replay", replay="reproducible"
    )
    assert snap.sampled_steps == 1  # found by replaying step 7, not by sampling it
    assert snap.nonfinite_steps == {"forward": 4, "backward": 4, "loss": 4}  # steps 7-10
    # the replay changed nothing: same parameters as the run without hookprof
    assert_same_parameters(reference, model)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_gradient_nan_on_an_unsampled_step(value):
    model = seeded(DeepNet)

    def poison(step, m):
        if step == 5:
            m.blocks[3].fc.weight.grad[0, 0] = value

    prof = hookprof.attach(model, **RARELY)
    start = transfer.transfer_count()
    run(model, 5, prof=prof, poison=poison)
    assert transfer.transfer_count() == start + 1  # step 1's sample; nothing since
    prof.detach()
    snap = prof.snapshot()
    assert snap.first_nonfinite == NonFiniteEvent(
        "blocks.3.fc", "backward", 5, found_by="backward check"
    )
    assert snap.nonfinite_steps == {"forward": 0, "backward": 1, "loss": 0}
    assert snap.layers["blocks.3.fc"].nonfinite["backward"] == 1
    assert sum(s.nonfinite["backward"] for s in snap.layers.values()) == 1


def test_the_loss_alone():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, **RARELY)
    run(
        model,
        4,
        prof=prof,
        loss_override=lambda step, loss: torch.tensor(float("nan")) if step == 3 else loss,
    )
    prof.detach()
    snap = prof.snapshot()
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 1}
    assert snap.first_nonfinite == NonFiniteEvent("(loss)", "loss", 3, found_by="loss check")


def test_counters_reach_the_exporter_with_the_next_sample():
    model = seeded(DeepNet)

    def poison(step, m):
        if step == 2:
            m.head.bias.grad[0] = float("nan")

    with hookprof.attach(
        model, port=0, sample_every=3, min_sample_interval_s=0.0, publish_interval_s=0.05
    ) as prof:
        run(model, 2, prof=prof, poison=poison)  # step 2 is not sampled
        time.sleep(0.5)  # ten publish intervals: what is published has step 2 ...
        assert prof.snapshot().step == 2
        assert prof.snapshot().nonfinite_steps["backward"] == 0  # ... not its device counters
        run(model, 2, prof=prof)  # step 4 is sampled and carries the counters
        snap = wait_for(
            "step 4's counters published",
            lambda: (lambda s: s if s.step == 4 and s.nonfinite_steps["backward"] else None)(
                prof.snapshot()
            ),
            interval=0.02,
            retry_errors=False,
        )
    assert snap.first_nonfinite == NonFiniteEvent("head", "backward", 2, found_by="backward check")
    assert snap.nonfinite_steps["backward"] >= 1


def test_flush_brings_the_counters_over_without_a_sample():
    """Issue 11: flush() makes the snapshot current, device counters included."""
    model = seeded(DeepNet)

    def poison(step, m):
        if step == 2:
            m.head.bias.grad[0] = float("nan")

    with hookprof.attach(model, **RARELY) as prof:
        run(model, 3, prof=prof, poison=poison)  # only step 1 is sampled
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 3 and snap.sampled_steps == 1
    assert snap.first_nonfinite == NonFiniteEvent("head", "backward", 2, found_by="backward check")
    assert snap.nonfinite_steps["backward"] == 2  # steps 2 and 3 (the NaN reached the weights)


def test_raise_policy_stops_at_the_next_step_boundary():
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[1].act, {4})
    prof = hookprof.attach(model, **RARELY, on_nonfinite="raise")
    try:
        with pytest.raises(hookprof.NonFiniteError) as info:
            run(model, 10, prof=prof, injector=injector)
    finally:
        prof.detach()
    err = info.value
    assert (err.layer, err.phase, err.step, err.rank) == ("blocks.1.act", "forward", 4, 0)
    assert "blocks.1.act" in str(err) and "step 4" in str(err)
    assert injector.step == 4  # raised at the end of step 4, not later


def test_dump_policy_writes_a_readable_report_and_keeps_training(tmp_path):
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[0].fc, {3})
    prof = hookprof.attach(model, **RARELY, on_nonfinite="dump", dump_dir=str(tmp_path))
    run(model, 6, prof=prof, injector=injector)
    prof.detach()
    assert prof.snapshot().step == 6
    # model, rank, process and step: never one file for two models or two processes
    files = list(tmp_path.glob(f"hookprof-nonfinite-DeepNet-rank0-pid{os.getpid()}-step3.json"))
    assert len(files) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [files[0].name]
    report = json.loads(files[0].read_text())
    assert report["incident"]["layer"] == "blocks.0.fc"
    assert report["incident"]["phase"] == "forward" and report["incident"]["step"] == 3
    assert set(report["layers"]) == set(prof.snapshot().layers)
    assert "blocks.0.fc" in report["summary"]


def test_warn_policy_logs_one_line(caplog):
    model = seeded(DeepNet)
    injector = StepInjector(model.head, {2})
    prof = hookprof.attach(model, **RARELY, on_nonfinite="warn")
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        run(model, 5, prof=prof, injector=injector)
    prof.detach()
    lines = [r.getMessage() for r in caplog.records if "NaN/Inf" in r.getMessage()]
    assert lines == [
        "hookprof: NaN/Inf in the forward phase at step 2 on rank 0, first in layer head "
        "(seen when the step was replayed); reproducible: a replay with the same inputs, "
        "weights and RNG made it again (the data or the model)"
    ]


def assert_same_parameters(a_model, b_model):
    """Bit for bit, NaNs in the same places."""
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("policy", ["record", "warn", "dump"])
def test_policies_that_keep_training_never_disturb_it(policy, tmp_path):
    """A NaN at step 5, then more steps: parameters identical to a run without hookprof."""
    reference = seeded(DeepNet)
    run(reference, 8, injector=StepInjector(reference.blocks[2].act, {5}))
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[2].act, {5})
    prof = hookprof.attach(model, **RARELY, on_nonfinite=policy, dump_dir=str(tmp_path))
    run(model, 8, prof=prof, injector=injector)
    prof.detach()
    assert prof.snapshot().first_nonfinite.layer == "blocks.2.act"
    assert_same_parameters(reference, model)


def test_gradscaler_skip_is_not_an_incident():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0)
    scaler_loop(model, torch.optim.SGD(model.parameters(), lr=0.01), 6, overflow_at={3})
    prof.detach()
    snap = prof.snapshot()
    assert snap.skipped_steps == 1
    assert snap.step == 6
    assert snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
    assert snap.first_nonfinite is None
    # norms of the last (unskipped) step are the unscaled gradients
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert snap.grad_norm == pytest.approx(expected.item(), rel=1e-5)


def test_persistent_gradscaler_skipping_becomes_an_incident():
    model = seeded(DeepNet)
    prof = hookprof.attach(model, port=0, max_skipped_steps=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler_loop(model, opt, 8, overflow_at=set(range(2, 9)))  # steps 2-8 all overflow
    model.zero_grad(set_to_none=True)  # the next iteration begins: its forward closes step 8
    model(model.batch(torch.Generator())[0])
    prof.detach()
    snap = prof.snapshot()
    assert snap.skipped_steps == 7
    assert snap.nonfinite_steps["backward"] == 4  # skips 4 to 7 in a row are past the limit
    assert snap.first_nonfinite.layer == "(gradscaler)"


def test_vanishing_and_exploding_gradients_are_flagged_per_layer():
    low, high = 0.05, 0.5
    model = seeded(DeepNet)
    reference: dict[str, list[float]] = {}

    def record(step, m):  # the gradient norms hookprof reads at this step, computed apart
        for name, module in m.named_modules():
            grads = [p.grad.flatten() for p in module.parameters(recurse=False)]
            if grads:
                reference.setdefault(name, []).append(
                    torch.linalg.vector_norm(torch.cat(grads)).item()
                )

    prof = hookprof.attach(
        model,
        port=0,
        sample_every=1,
        min_sample_interval_s=0.0,
        vanishing_grad_norm=low,
        exploding_grad_norm=high,
    )
    run(model, 4, prof=prof, poison=record)
    prof.detach()
    snap = prof.snapshot()
    any_low = any_high = 0
    for name, norms in reference.items():
        flags = snap.layers[name].gradient_flags
        assert flags["vanishing"] == sum(n < low for n in norms), name
        assert flags["exploding"] == sum(n > high for n in norms), name
    for step in range(4):
        any_low += any(norms[step] < low for norms in reference.values())
        any_high += any(norms[step] > high for norms in reference.values())
    assert snap.gradient_flagged_steps == {"vanishing": any_low, "exploding": any_high}
    assert any_low and any_high  # the bounds were chosen so that both happen


def test_bf16_autocast_nan_is_an_incident():
    """No scaler: a non-finite value under bf16 autocast is a real incident, localised."""
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[1].fc, {3})
    prof = hookprof.attach(model, **RARELY)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 5):
        injector.step = step
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, model.batch(g))
        loss.backward()
        opt.step()
        prof.step(loss)
    prof.detach()
    snap = prof.snapshot()
    assert snap.skipped_steps == 0
    assert snap.first_nonfinite.layer == "blocks.1.fc"
    assert (snap.first_nonfinite.phase, snap.first_nonfinite.step) == ("forward", 3)


def test_gradient_made_non_finite_by_a_tensor_hook():
    """The gradient of one layer's weight turned NaN inside backward (a tensor hook, as a bad
    custom backward would): a backward incident of that layer, at that step."""
    model = seeded(DeepNet)
    state = {"step": 0}

    def poison(grad):
        return grad + float("nan") if state["step"] == 4 else None

    handle = model.blocks[1].fc.weight.register_hook(poison)
    prof = hookprof.attach(model, **RARELY)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 6):
        state["step"] = step
        opt.zero_grad(set_to_none=True)
        loss_of(model, model.batch(g)).backward()
        opt.step()
    prof.detach()
    handle.remove()
    snap = prof.snapshot()
    assert snap.first_nonfinite == NonFiniteEvent(
        "blocks.1.fc", "backward", 4, found_by="backward check"
    )
    assert snap.layers["blocks.1.fc"].nonfinite["backward"] >= 1


def test_activation_statistics_are_rate_limited_and_replay_covers_the_gap():
    """Sampling every step, activation statistics at most once an hour: only step 1 has them,
    their gauges persist, and a NaN at step 4 is still localised (by replaying step 4)."""
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[3].fc, {4})
    prof = hookprof.attach(
        model, port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=3600.0
    )
    run(model, 5, prof=prof, injector=injector)
    prof.detach()
    snap = prof.snapshot()
    assert snap.sampled_steps == 5
    assert snap.layers["blocks.0.act"].activation_zero_ratio is not None  # kept from step 1
    order = model.order()
    assert snap.first_nonfinite == NonFiniteEvent(
        "blocks.3.fc",
        "forward",
        4,
        tuple(order[order.index("blocks.3.fc") + 1 :]),
        found_by="replay",
        replay="reproducible",
    )
