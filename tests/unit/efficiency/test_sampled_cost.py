"""Work on sampled steps done once rather than per call or per measurement (issue 13): the
precision read once per step at its first layer call, FLOP noting that never raises into
the loop, the peak looked up once per (device, precision), the update norms' grouping
kept until the optimizer's parameter groups change."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.efficiency import peaks
from hookprof.efficiency.figures import StepEfficiency
from hookprof.layers import LayerTable
from hookprof.notices import Notices

# the every_step fixture, with update norms measured on every step too
pytestmark = pytest.mark.every_step(update_norm_interval_s=0.0)


class AutocastInside(nn.Module):
    """A model that switches bf16 autocast on inside its own forward (the `@autocast()` on
    forward pattern of torch's AMP docs): the root's forward pre-hook runs before it."""

    def __init__(self, device: str = "cpu", width: int = 16, hidden: int = 16, out: int = 4):
        super().__init__()
        self.device_type = device
        self.a = nn.Linear(width, hidden)
        self.b = nn.Linear(hidden, out)

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.b(torch.relu(self.a(x))).float()


def train(model, prof, x, steps):
    """`steps` SGD steps of `model` on `x`; the snapshot after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    prof.flush()
    return prof.snapshot()


def test_precision_is_read_once_per_sampled_step_inside_the_forward(every_step, monkeypatch):
    """The precision is read at each sampled step's first layer call, where autocast set in
    the model's own forward is on, once per step, not once per layer call."""
    seen = []
    real = peaks.precision_of

    def spy(dtype, device_type):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(dtype, device_type)

    monkeypatch.setattr(peaks, "precision_of", spy)
    torch.manual_seed(0)
    model = AutocastInside()
    with hookprof.attach(model, peak_flops=1e12, **every_step) as prof:
        snap = train(model, prof, torch.randn(8, 16), 4)
    assert snap.sampled_steps == 4 and snap.internal_errors == 0
    assert seen == [True] * 4  # one read per step (two layer calls each), autocast on at each
    assert snap.efficiency.layers["a"].forward_flops == 2 * 8 * 16 * 16


def test_a_failing_flops_note_is_said_once_and_the_hooks_stay_on(every_step, monkeypatch):
    """FlopCounter.note is what the layer hooks call on every layer call of a sampled step:
    a failure in it never reaches the loop nor switches the per-layer timing off."""

    def broken(value):
        raise RuntimeError("signature")

    monkeypatch.setattr(*_testing.flop_key_seam(), broken)  # a call with two arguments uses it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Bilinear(8, 8, 8), nn.Linear(8, 8))
    first, second = model[0], model[1]
    model.forward = lambda x: second(first(x, x))
    with hookprof.attach(model, **every_step) as prof:
        snap = train(model, prof, torch.randn(4, 8), 3)
    assert snap.internal_errors == 0
    assert sum("FLOPs of layer calls cannot be noted" in n for n in snap.notices) == 1, snap.notices
    assert snap.layers["0"].calls == 1 and snap.layers["1"].calls == 1  # timed at the last step
    assert snap.layers["0"].forward_seconds > 0 and snap.layers["1"].forward_seconds > 0
    assert snap.efficiency.layers["0"].forward_flops is None  # its note failed
    assert snap.efficiency.layers["1"].forward_flops == 2 * 4 * 8 * 8  # forward(x): no _key


@pytest.mark.cuda
def test_autocast_inside_the_forward_gives_the_bf16_peak_on_cuda():
    """On a GPU: a model that enables bf16 autocast in its own forward gets MFU against the
    device's bf16 peak (when the GPU is a listed one), not its fp32/tf32 one."""
    name = torch.cuda.get_device_name()
    if peaks.lookup(name, "bf16") is None:
        pytest.skip(f"no listed peak for {name}")
    torch.manual_seed(0)
    model = AutocastInside("cuda", 256, 1024, 256).cuda()
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        eff = train(model, prof, torch.randn(64, 256, device="cuda"), 4).efficiency
    assert eff.flops_utilization == pytest.approx(eff.flops_per_second / peaks.lookup(name, "bf16"))
    assert not math.isclose(peaks.lookup(name, "bf16"), peaks.lookup(name, "tf32"))


class ListeningHooks:
    """LayerHooks' listening surface (listen; on_call is what the hooks call)."""

    on_call = None

    def listen(self, on_call):
        self.on_call = on_call


def efficiency_steps(eff, x, precisions):
    """Sampled steps of a StepEfficiency as the layer hooks drive it, one layer call each:
    the peak each step ends with."""
    hooks = ListeningHooks()
    eff.listen(hooks)
    got = []
    for step, precision in enumerate(precisions, 1):
        peaks_precision[0] = precision
        hooks.on_call(0, (x,), None, False)
        part = eff.end_step(step, step * 10**9, 1.0)
        got.append(part.peak_flops)
    return got


peaks_precision = [None]  # what the patched precision_of answers


def test_the_peak_is_looked_up_once_per_device_and_precision(monkeypatch):
    """The peak's regexes run once per precision, the device's name is read once per
    profiler; a step in another precision, and a profiler on another device, get their own."""
    names, lookups = [], []
    device = ["NVIDIA H100 80GB HBM3"]
    real_lookup = peaks.lookup

    def device_name(d):
        names.append(device[0])
        return device[0]

    def lookup(name, precision):
        lookups.append((name, precision))
        return real_lookup(name, precision)

    monkeypatch.setattr(peaks, "device_name", device_name)
    monkeypatch.setattr(peaks, "lookup", lookup)
    monkeypatch.setattr(peaks, "precision_of", lambda dtype, device_type: peaks_precision[0])
    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)

    def profiler_half():
        return StepEfficiency(
            LayerTable(model),
            flops=True,
            update_norms=False,
            update_max_bytes=0,
            peak_flops=None,
            notices=Notices(),
        )

    h100 = profiler_half()
    order = ["bf16", "bf16", "tf32", "bf16", "fp32", "tf32"]
    assert efficiency_steps(h100, x, order) == [
        real_lookup("NVIDIA H100 80GB HBM3", p) for p in order
    ]
    assert names == ["NVIDIA H100 80GB HBM3"]
    assert lookups == [("NVIDIA H100 80GB HBM3", p) for p in ("bf16", "tf32", "fp32")]
    device[0] = "NVIDIA A100-SXM4-80GB"
    a100 = profiler_half()
    assert efficiency_steps(a100, x, ["bf16", "tf32"]) == [312e12, 156e12]
    assert efficiency_steps(h100, x, ["bf16"]) == [1979 / 2 * 1e12]  # its own device's, still
    assert names == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    assert len(lookups) == 5


def test_a_param_group_added_mid_run_is_measured_and_the_grouping_kept_until_then(
    every_step, monkeypatch
):
    """Update norms regroup the parameters only when the optimizer's parameter groups
    change: a backbone frozen at attach, unfrozen later with a param group of its own, has
    its updates measured from then on, exactly."""
    regroups = []
    real_group = getattr(*_testing.update_norm_grouping_seam())
    monkeypatch.setattr(
        *_testing.update_norm_grouping_seam(),
        lambda self: (regroups.append(1), real_group(self))[1],
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    backbone, head = model[0], model[2]
    backbone.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)

    def step():
        before = [p.detach().clone() for p in (*backbone.parameters(), *head.parameters())]
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        prof.flush()
        after = [p.detach() for p in (*backbone.parameters(), *head.parameters())]
        d = [a - b for a, b in zip(after, before)]
        return (
            math.sqrt(sum(t.square().sum().item() for t in d[:2])),
            math.sqrt(sum(t.square().sum().item() for t in d[2:])),
        )

    with hookprof.attach(model, **every_step) as prof:
        for _ in range(3):
            _, head_update = step()
            eff = prof.snapshot().efficiency
            assert eff.layers["2"].update_norm == pytest.approx(head_update, rel=1e-5)
            assert eff.layers["0"].update_norm is None  # frozen: not updated
            assert eff.layers["0"].weight_norm is not None  # its weights are read all the same
        assert len(regroups) == 1  # at attach only: three measurements, one grouping
        backbone.requires_grad_(True)
        opt.add_param_group({"params": backbone.parameters(), "lr": 0.05})
        for _ in range(2):
            backbone_update, head_update = step()
            eff = prof.snapshot().efficiency
            assert backbone_update > 0
            assert eff.layers["0"].update_norm == pytest.approx(backbone_update, rel=1e-5)
            assert eff.layers["2"].update_norm == pytest.approx(head_update, rel=1e-5)
        assert len(regroups) == 2  # once more, for the added group
