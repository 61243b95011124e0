"""FLOPs per layer, achieved FLOP/s and MFU, weight and update norms (issue 15): values
against independent computations, counted once per shape, numerics unchanged, the cap on
parameter copies, and what reaches /metrics."""

from __future__ import annotations

import copy
import math
import subprocess

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import hookprof
import hookprof.efficiency.flops
from hookprof import _testing
from hookprof.efficiency import peaks
from hookprof.efficiency.updates import UpdateNorms
from hookprof.layers import LayerTable
from support.binaries import promtool
from support.metrics import parse, samples, scrape

# the every_step fixture, with update norms measured on every step too
pytestmark = pytest.mark.every_step(update_norm_interval_s=0.0)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def sgd_steps(model, prof, steps, batch=8, lr=0.1, optimizer=None, before_last=None):
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(batch, 32, generator=g)
        if before_last is not None and i == steps - 1:
            before_last.extend(p.detach().clone() for p in model.parameters())
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    prof.flush()
    return prof.snapshot()


def test_layer_flops_are_the_matmul_counts_and_add_up_to_flop_counter_mode(every_step):
    model = mlp()
    with hookprof.attach(model, **every_step) as prof:
        snap = sgd_steps(model, prof, 3, batch=8)
    eff = snap.efficiency
    first, second = eff.layers["0"], eff.layers["2"]
    # a Linear is 2*B*in*out FLOPs forward; backward computes the weight gradient (same
    # count) and, except for the first layer whose input needs no gradient, the input's
    assert first.forward_flops == 2 * 8 * 32 * 64
    assert first.backward_flops == 2 * 8 * 32 * 64
    assert second.forward_flops == 2 * 8 * 64 * 16
    assert second.backward_flops == 2 * (2 * 8 * 64 * 16)
    assert eff.layers["1"].forward_flops == 0  # FlopCounterMode counts no elementwise op
    # the model's step: FlopCounterMode over the real model's forward and backward
    x = torch.randn(8, 32)
    with FlopCounterMode(display=False) as counter:
        mlp()(x).square().mean().backward()
    assert eff.flops_per_step == counter.get_total_flops()
    assert first.flops_per_second > 0 and eff.flops_per_second > 0
    assert snap.internal_errors == 0


def test_counted_once_per_layer_kind_and_shape(every_step, monkeypatch):
    calls = []
    real = hookprof.efficiency.flops.count

    def counting(module, args, kwargs):
        calls.append((type(module).__name__, args[0].shape))
        return real(module, args, kwargs)

    monkeypatch.setattr(hookprof.efficiency.flops, "count", counting)
    torch.manual_seed(0)
    # four identical blocks: one kind, counted once
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    with hookprof.attach(model, **every_step) as prof:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for batch in (8, 8, 8, 4, 4, 8):
            model(torch.randn(batch, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
        prof.flush()
        snap = prof.snapshot()
    # the first layer's input needs no gradient, the others' do: two signatures per batch size
    assert sorted(calls) == sorted([("Linear", (8, 32))] * 2 + [("Linear", (4, 32))] * 2)
    assert snap.efficiency.layers["3"].forward_flops == 2 * 8 * 32 * 32  # the last step's shape


def test_numerics_unchanged_with_dropout_and_every_step_sampling(every_step):
    """Meta-tensor counting must not draw from the random generator (dropout would differ)."""

    def run(attach):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.Linear(64, 16))
        prof = hookprof.attach(model, **every_step) if attach else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        for _ in range(6):
            loss = model(torch.randn(8, 32)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if prof is not None:
            prof.flush()
            assert prof.snapshot().efficiency.update_ratio is not None
            prof.detach()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_update_and_weight_norms_equal_the_parameter_change(every_step):
    model = mlp()
    before: list[torch.Tensor] = []
    with hookprof.attach(model, **every_step) as prof:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # an update that is not -lr * grad
        snap = sgd_steps(model, prof, 4, optimizer=opt, before_last=before)
    after = [p.detach() for p in model.parameters()]
    deltas = [a - b for a, b in zip(after, before)]
    eff = snap.efficiency
    upd_sq, w_sq = 0.0, 0.0
    for layer, (d_w, d_b, w, b) in {
        "0": (*deltas[0:2], *after[0:2]),
        "2": (*deltas[2:4], *after[2:4]),
    }.items():
        u = math.sqrt(d_w.square().sum().item() + d_b.square().sum().item())
        n = math.sqrt(w.square().sum().item() + b.square().sum().item())
        assert eff.layers[layer].update_norm == pytest.approx(u, rel=1e-5)
        assert eff.layers[layer].weight_norm == pytest.approx(n, rel=1e-6)
        assert eff.layers[layer].update_ratio == pytest.approx(u / n, rel=1e-5)
        upd_sq, w_sq = upd_sq + u * u, w_sq + n * n
    assert eff.layers["1"].weight_norm is None and eff.layers["1"].update_norm is None  # ReLU
    assert eff.update_ratio == pytest.approx(math.sqrt(upd_sq / w_sq), rel=1e-5)


def test_layers_take_turns_under_the_byte_cap(every_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a cap below one layer: one layer is copied per sampled step, in turn
    with hookprof.attach(model, update_norm_max_bytes=1, **every_step) as prof:
        for step in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            prof.flush()
            turn = str(step % 3)
            k = int(turn) * 2
            d = [
                model[int(turn)].weight.detach() - before[k],
                model[int(turn)].bias.detach() - before[k + 1],
            ]
            expected = math.sqrt(sum(t.square().sum().item() for t in d))
            assert prof.snapshot().efficiency.layers[turn].update_norm == pytest.approx(
                expected, rel=1e-5
            )
        measured = {
            n for n, s in prof.snapshot().efficiency.layers.items() if s.update_norm is not None
        }
        assert measured == {"0", "1", "2"}


def test_update_norms_at_most_once_per_interval(every_step):
    """Sampling every step does not copy the parameters every step: the first sampled step
    measures, the next ones within update_norm_interval_s do not (the figures stay)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    with hookprof.attach(model, **{**every_step, "update_norm_interval_s": 3600.0}) as prof:
        first = None
        for step in range(3):
            before = model[0].weight.detach().clone(), model[0].bias.detach().clone()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                first = math.sqrt(
                    (model[0].weight.detach() - before[0]).square().sum().item()
                    + (model[0].bias.detach() - before[1]).square().sum().item()
                )
        prof.flush()
        snap = prof.snapshot()
    assert snap.sampled_steps == 3
    assert snap.efficiency.layers["0"].update_norm == pytest.approx(first, rel=1e-5)


def test_turns_fill_the_cap_and_a_large_layer_goes_alone():
    model = nn.Sequential(
        nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(100, 100), nn.Linear(10, 10)
    )
    sizes = [(10 * 10 + 10) * 4, (10 * 10 + 10) * 4, (100 * 100 + 100) * 4, (10 * 10 + 10) * 4]
    norms = UpdateNorms(LayerTable(model), max_bytes=sizes[0] * 2)
    turns = [_testing.next_update_norm_turn(norms) for _ in range(4)]
    assert turns == [[0, 1], [2], [3, 0], [1]]
    # what each turn holds: at most max(cap, the largest layer), the large layer alone
    norms = UpdateNorms(LayerTable(model), max_bytes=sizes[0] * 2)
    held = []
    for _ in range(4):
        norms.before_update()
        held.append(
            sum(
                copy.numel() * copy.element_size()
                for _, copy in _testing.held_parameter_copies(norms)
            )
        )
        norms.drop()
    assert held == [sizes[0] + sizes[1], sizes[2], sizes[3] + sizes[0], sizes[1]]


def test_mfu_against_a_set_peak_and_the_metrics_on_the_page(every_step, tmp_path):
    model = mlp()
    with hookprof.attach(model, peak_flops=1e12, **every_step) as prof:
        snap = sgd_steps(model, prof, 4)
        text = scrape(prof.url)
    eff = snap.efficiency
    assert eff.flops_utilization == pytest.approx(eff.flops_per_second / 1e12)
    f = parse(text)
    assert samples(f, "hookprof_model_flops_utilization_ratio") == {
        frozenset({"rank": "0"}.items()): pytest.approx(eff.flops_utilization)
    }
    assert (
        samples(f, "hookprof_layer_forward_flops")[frozenset({"rank": "0", "layer": "0"}.items())]
        == 2 * 8 * 32 * 64
    )
    assert samples(f, "hookprof_update_ratio") == {
        frozenset({"rank": "0"}.items()): pytest.approx(eff.update_ratio)
    }
    for name in (
        "hookprof_layer_backward_flops",
        "hookprof_layer_flops_per_second",
        "hookprof_model_flops_per_second",
        "hookprof_layer_weight_norm",
        "hookprof_layer_update_norm",
        "hookprof_layer_update_ratio",
    ):
        assert samples(f, name), name
    page = tmp_path / "page.txt"
    page.write_text(text)
    result = subprocess.run(
        [promtool(), "check", "metrics"], stdin=page.open(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_unknown_peak_on_cpu_is_said_and_no_mfu_exported(every_step):
    model = mlp()
    with hookprof.attach(model, **every_step) as prof:
        snap = sgd_steps(model, prof, 2)
        text = scrape(prof.url)
    assert snap.efficiency.flops_per_second > 0 and snap.efficiency.flops_utilization is None
    assert any("peak FLOP/s" in n and "peak_flops" in n for n in snap.notices)
    assert "hookprof_model_flops_utilization_ratio" not in text


def test_features_off_export_nothing(every_step):
    model = mlp()
    with hookprof.attach(model, flop_counting=False, update_norms=False, **every_step) as prof:
        snap = sgd_steps(model, prof, 2)
        text = scrape(prof.url)
    assert snap.efficiency is None
    families = set(parse(text))
    assert families and not [
        f for f in families if any(w in f for w in ("flops", "update_ratio", "weight_norm"))
    ]


class ReadsAValue(nn.Module):
    """A layer whose forward reads a tensor's value: it cannot run on meta tensors."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, x):
        scale = 2.0 if x.abs().max().item() > 1e9 else 1.0
        return nn.functional.linear(x, self.weight) * scale


def sum_steps(model: nn.Module, x: torch.Tensor, steps: int = 3) -> None:
    """`steps` SGD steps on the sum of the model's output (a fresh optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_layer_that_cannot_run_on_meta_tensors_is_said_and_skipped(every_step):
    torch.manual_seed(0)
    model = nn.Sequential(ReadsAValue(), nn.Linear(32, 32))
    reference = copy.deepcopy(model)
    with hookprof.attach(model, **every_step) as prof:
        sum_steps(model, torch.ones(4, 32))
        prof.flush()
        snap = prof.snapshot()
    assert snap.internal_errors == 0
    assert snap.efficiency.layers["0"].forward_flops is None
    assert snap.efficiency.layers["1"].forward_flops == 2 * 4 * 32 * 32
    assert any("FLOPs of layer 0 cannot be counted" in n for n in snap.notices), snap.notices
    sum_steps(reference, torch.ones(4, 32))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_an_in_place_layer_is_counted_not_refused(every_step):
    """ReLU(inplace=True) after a layer (every torchvision ResNet): its meta input was built
    as a leaf that requires grad, on which an in-place op raises, so the layer was said to
    be uncountable (seen on the first GPU run's ResNet-50). It does no matmul: 0 FLOPs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    with hookprof.attach(model, **every_step) as prof:
        sum_steps(model, torch.randn(5, 8))
        prof.flush()
        snap = prof.snapshot()
    layers = snap.efficiency.layers
    assert (layers["1"].forward_flops, layers["1"].backward_flops) == (0, 0)
    # the first layer's input needs no gradient: its backward is the weight gradient only
    assert (layers["0"].forward_flops, layers["0"].backward_flops) == (
        2 * 5 * 8 * 16,
        2 * 5 * 8 * 16,
    )
    assert (layers["2"].forward_flops, layers["2"].backward_flops) == (
        2 * 5 * 16 * 4,
        4 * 5 * 16 * 4,
    )
    assert not [n for n in snap.notices if "cannot be counted" in n], snap.notices


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
        ("NVIDIA H100 PCIe", "tf32", 378e12),
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A100-PCIE-40GB", "fp16", 312e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 366.5e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
        ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # fp32 with TF32 allowed runs at fp32 rate
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("NVIDIA A10G", "bf16", None),  # no datasheet: unknown rather than guessed
        ("NVIDIA B200", "bf16", None),
        ("NVIDIA H100 80GB HBM3", "fp64", None),
    ],
)
def test_peak_lookup_by_device_name(name, precision, expected):
    got = peaks.lookup(name, precision)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.cuda
def test_no_sync_and_a_known_peak_on_cuda():
    """On a GPU: FLOP counting and update norms add no host-device sync on the training
    thread, and the GPU's name gives MFU (when it is a listed one) in bf16 autocast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    with hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        for step in range(6):
            if step == 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        prof.flush()
        snap = prof.snapshot()
    assert snap.internal_errors == 0
    eff = snap.efficiency
    assert eff.layers["0"].forward_flops == 2 * 64 * 256 * 1024
    assert eff.update_ratio is not None and eff.update_ratio > 0
    name = torch.cuda.get_device_name()
    if peaks.lookup(name, "bf16") is not None:
        assert eff.flops_utilization == pytest.approx(
            eff.flops_per_second / peaks.lookup(name, "bf16")
        )


def update_norm_of(model: nn.Sequential, before: list[torch.Tensor], layer: int) -> float:
    """||after - before|| of one Linear of `model` (weight and bias), computed here."""
    params = [model[layer].weight, model[layer].bias]
    return math.sqrt(sum((p.detach() - b).square().sum().item() for p, b in zip(params, before)))


def test_closure_steps_measure_their_updates_every_sampled_step(every_step):
    """optimizer.step(closure) (Lightning's automatic optimization, LBFGS, SAM) runs the
    forward inside the step: the update norms of every sampled step are this step's, not
    step 1's kept for the whole run."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with hookprof.attach(model, **{**every_step, "update_norm_interval_s": 0.0}) as prof:
        for _ in range(4):
            x = torch.randn(8, 32, generator=g)

            def closure():
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss

            before = [model[0].weight.detach().clone(), model[0].bias.detach().clone()]
            opt.step(closure)
            prof.flush()
            assert prof.snapshot().efficiency.layers["0"].update_norm == pytest.approx(
                update_norm_of(model, before, 0), rel=1e-5
            )


def test_an_update_the_guard_held_back_is_not_measured_as_zero(every_step):
    """Under on_nonfinite="skip" a held-back step changes no weight; that is no update of
    size 0: the figures stay those of the last step that updated."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with hookprof.attach(
        model, **{**every_step, "update_norm_interval_s": 0.0}, on_nonfinite="skip"
    ) as prof:
        for step in range(1, 5):
            x = torch.randn(8, 32, generator=g)
            if step == 3:
                x[0, 0] = float("nan")
            before = [model[0].weight.detach().clone(), model[0].bias.detach().clone()]
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.flush()
            if step == 2:
                expected = update_norm_of(model, before, 0)
            eff = prof.snapshot().efficiency
            if step == 3:  # held back: the figures stay step 2's
                assert prof.snapshot().held_back_updates == 1
                assert eff.layers["0"].update_norm == pytest.approx(expected, rel=1e-5)
        assert eff.layers["0"].update_norm == pytest.approx(
            update_norm_of(model, before, 0), rel=1e-5
        )  # step 4


def test_flops_of_a_layer_called_with_keywords_under_a_user_forward_hook(every_step):
    """A layer with a forward hook of the user's gets hookprof's hook pair (not the forward
    wrapper); called as layer(input=x), its FLOPs are still counted with the keywords."""

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 16)
            self.a.register_forward_hook(lambda module, args, output: None)

        def forward(self, x):
            return self.b(self.a(input=x))

    torch.manual_seed(0)
    model = Keywords()
    with hookprof.attach(model, **every_step) as prof:
        snap = sgd_steps(model, prof, 2)
    assert snap.efficiency.layers["a"].forward_flops == 2 * 8 * 32 * 64
    assert not [n for n in snap.notices if "cannot be counted" in n]
