"""Every step's loss and global gradient norm reach the history (issue 41), not only the
sampled steps': checked against the test's own per-step values, on the CPU's path, on the
accelerator's path with every copy lagging three steps behind, and through a divergence
nobody injected (a learning rate that grows until the loss overflows)."""

from __future__ import annotations

import math

import pytest
import torch

import hookprof
from hookprof.publish import every_step
from hookprof.step import series
from hookprof.step.gradients import GradientNorms
from support.lagging_device import lagging_device
from support.models import DeepNet, loss_of, seeded
from support.settings import RARELY


def _own_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads))


def _run(model, steps, *, lr=0.05, grow_from=None, loss_every=1):
    """SGD with momentum, prof.step(loss) after each update (the loss of every
    `loss_every`-th step only); the learning rate grows 8% a step from `grow_from` on.
    Returns {step: (loss, norm)} as the test saw them (the norm before the update)."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    seen = {}
    with hookprof.attach(model, **RARELY) as prof:
        for step in range(1, steps + 1):
            if grow_from is not None and step >= grow_from:
                for group in opt.param_groups:
                    group["lr"] *= 1.08
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, model.batch(g))
            loss.backward()
            norm = _own_norm(model)
            opt.step()
            given = step % loss_every == 0
            prof.step(loss if given else None)
            seen[step] = (float(loss) if given else None, norm)
        prof.flush()
        view = prof.report_document()["history"]["every_step"]
        view["duration_sum"] = prof.snapshot().step_duration_sum  # (the counters' own sum)
    return seen, view


def _stored(v):
    return None if v is None else (v if math.isfinite(v) else math.inf)


def _check_rows(rows, seen, steps):
    assert rows["step"] == [float(s) for s in steps]
    for s, loss, norm in zip(steps, rows["loss"], rows["grad_norm"]):
        own_loss, own_norm = seen[s]
        own_loss, own_norm = _stored(own_loss), _stored(own_norm)
        if own_loss is None or math.isinf(own_loss):
            assert loss == own_loss, s
        else:  # the ring is float32, as the loss is
            assert loss == pytest.approx(own_loss, rel=1e-6), s
        if math.isinf(own_norm):
            assert norm == math.inf, s
        else:
            assert norm == pytest.approx(own_norm, rel=2e-5), s


def _check_bands(bands, seen, last_banded):
    """Each band's min, max and mean against the steps it covers, computed apart."""
    covered = []
    for i, (first, last) in enumerate(zip(bands["first"], bands["last"])):
        covered.extend(range(int(first), int(last) + 1))
        for col, k in (("loss", 0), ("grad_norm", 1)):
            values = [seen[s][k] for s in range(int(first), int(last) + 1)]
            finite = [v for v in values if v is not None and math.isfinite(v)]
            assert bands[f"{col}_n"][i] == len(finite)
            assert bands[f"{col}_bad"][i] == sum(
                1 for v in values if v is not None and not math.isfinite(v)
            )
            if finite:
                assert bands[f"{col}_min"][i] == pytest.approx(min(finite), rel=2e-5)
                assert bands[f"{col}_max"][i] == pytest.approx(max(finite), rel=2e-5)
                assert bands[f"{col}_mean"][i] == pytest.approx(sum(finite) / len(finite), rel=2e-5)
    assert covered == list(range(1, last_banded + 1))


@pytest.mark.parametrize("path", ["cpu", "accelerator, lagging 3 steps"])
def test_every_step_of_a_long_run_is_in_the_history(monkeypatch, path):
    """700 steps (more than the device ring's 512 and the full-resolution window's 512):
    the last FULL steps exact, the older ones in bands whose min/max/mean are right."""
    steps = 700
    model = seeded(DeepNet)
    if path == "cpu":
        seen, view = _run(model, steps)
    else:
        monkeypatch.setattr(GradientNorms, "cpu_dot_per_tensor", False)
        with lagging_device(3):
            seen, view = _run(model, steps)
    duration_sum = view["duration_sum"]
    kept = range(steps - every_step.FULL + 1, steps + 1)
    _check_rows(view["full"], seen, kept)
    _check_bands(view["bands"], seen, kept[0] - 1)
    assert view["incident"] is None
    # every step's time (the host's, as the step counters took it): none missing, and the
    # bands' and the full rows' add up to the counters' sum of all steps
    full, bands = view["full"], view["bands"]
    assert all(t is not None and t > 0 for t in full["step_seconds"])
    assert sum(bands["step_seconds_n"]) + len(full["step_seconds"]) == steps
    banded = sum(m * n for m, n in zip(bands["step_seconds_mean"], bands["step_seconds_n"]))
    assert banded + sum(full["step_seconds"]) == pytest.approx(duration_sum, rel=1e-9)


def test_steps_without_a_loss_have_none_and_still_a_norm():
    seen, view = _run(seeded(DeepNet), 40, loss_every=3)
    _check_rows(view["full"], seen, range(1, 41))
    assert view["full"]["loss"][0] is None and view["full"]["loss"][2] is not None


def test_a_divergence_keeps_its_lead_up_at_full_resolution(monkeypatch):
    """The learning rate grows until the loss overflows (nothing injected); the run goes on
    far past it: the steps before the first non-finite one, and a few after, stay exact."""
    monkeypatch.setattr(GradientNorms, "cpu_dot_per_tensor", False)
    with lagging_device(3):
        seen, view = _run(seeded(DeepNet), 1200, grow_from=300)
    first_bad = min(s for s, (loss, norm) in seen.items() if not math.isfinite(loss * norm))
    assert 300 < first_bad < 1200 - every_step.FULL, first_bad  # out of the recent window
    assert view["incident"] == first_bad
    low = first_bad - every_step.LEAD_UP
    lead_up = [s for s in view["full"]["step"] if s < 1200 - every_step.FULL + 1]
    assert lead_up == [float(s) for s in range(low, first_bad + every_step.AFTER + 1)]
    n = len(lead_up)
    rows = {k: v[:n] for k, v in view["full"].items()}
    _check_rows(rows, seen, range(low, first_bad + every_step.AFTER + 1))
    # the bands count the non-finite steps instead of drawing them
    assert sum(view["bands"]["loss_bad"]) == sum(
        1 for s in range(1, 1200 - every_step.FULL + 1) if not math.isfinite(seen[s][0])
    )


def test_a_drain_is_forced_before_the_ring_wraps():
    """No sampled step for a long while (RARELY): the ring is still read in time."""
    assert series.DRAIN_EVERY < series.RING
    seen, view = _run(seeded(DeepNet), series.RING + 100)
    _check_rows(view["full"], seen, range(101, series.RING + 101))


def _fused_scaler_run(optimizers, model, steps, overflow_at=()):
    """fused Adam under one CPU GradScaler; the scaled loss overflows at `overflow_at` (the
    scaler skips those steps). Returns (the loop's own unscaled norms, every_step's view)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    own = {}
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(model, **RARELY) as prof:
        for step in range(1, steps + 1):
            for opt in optimizers:
                opt.zero_grad()
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            scaler.scale(loss * (1e35 if step in overflow_at else 1)).backward()
            scale = float(scaler.get_scale())
            own[step] = math.sqrt(
                sum(float((p.grad.double() / scale).pow(2).sum()) for p in model.parameters())
            )
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
            prof.step(loss.detach())
        prof.flush()
        return own, prof.report_document()["history"]["every_step"]


def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_a_fused_gradscaler_skip_is_no_value_and_no_incident():
    """A fused optimizer reads the gradients still scaled: the norm is unscaled, and the step
    the scaler skips for an overflow is no value, not a divergence (review of issue 41)."""
    model = _small_model()
    own, view = _fused_scaler_run(
        [torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)], model, 8, overflow_at={5}
    )
    norms = dict(zip(view["full"]["step"], view["full"]["grad_norm"]))
    assert norms[5.0] is None and view["incident"] is None
    for s in (1, 2, 3, 4, 6, 7, 8):
        assert norms[float(s)] == pytest.approx(own[s], rel=1e-5), s


def test_two_fused_optimizers_under_one_scaler_unscale_the_norm_once():
    model = _small_model()
    optimizers = [
        torch.optim.Adam(model[0].parameters(), lr=1e-3, fused=True),
        torch.optim.Adam(model[2].parameters(), lr=1e-3, fused=True),
    ]
    own, view = _fused_scaler_run(optimizers, model, 5)
    for s, norm in zip(view["full"]["step"], view["full"]["grad_norm"]):
        assert norm == pytest.approx(own[int(s)], rel=1e-5), s


def test_a_loop_that_catches_nonfinite_error_keeps_each_steps_values_its_own():
    """Under on_nonfinite="raise" a loop may catch the error and train on: the next steps'
    values stay theirs (the next step is planned although the step's end raised)."""
    model = seeded(DeepNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    losses = {}
    with hookprof.attach(model, on_nonfinite="raise", **RARELY) as prof:
        for step in range(1, 13):
            opt.zero_grad()
            loss = loss_of(model, model.batch(g)) * (math.nan if step == 5 else 1.0)
            loss.backward()
            opt.step()
            losses[step] = float(loss)
            try:
                prof.step(loss)
            except hookprof.NonFiniteError:
                pass
        prof.flush()
        full = prof.report_document()["history"]["every_step"]["full"]
    assert full["step"] == [float(s) for s in range(1, 13)]
    for s, loss in zip(range(1, 13), full["loss"]):
        if s == 5:
            assert loss == math.inf
        else:
            assert loss == pytest.approx(losses[s], rel=1e-6), s
