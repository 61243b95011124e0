"""The every-step gradient check (`GradientNorms.layer_checks`, the accelerator's path):
per layer, non-finite exactly when that layer's gradients hold a NaN or Inf, whatever the
gradients' dtypes, shapes and sizes, against a reference computed apart (`torch.isfinite`
of each gradient), and a handful of ops whatever their number."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hookprof.layers import LayerTable
from hookprof.step import gradients
from hookprof.step.gradients import GradientNorms
from support.op_counter import OpCounter


@pytest.fixture
def accelerator_path(monkeypatch):
    monkeypatch.setattr(GradientNorms, "cpu_dot_per_tensor", False)


class Awkward(nn.Module):
    """fp32, fp16 and bf16 layers, a 0-d parameter, an empty one, a gradient larger than
    one summed piece, a layer holding two parameters of different dtypes, and a
    channels_last convolution (its gradient is not contiguous)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.fp16 = nn.Linear(4, 4).half()
        self.brain = nn.Linear(4, 4).to(torch.bfloat16)
        self.temperature = nn.Parameter(torch.tensor(1.0))  # the root's own, 0-d
        self.big = nn.Embedding(3 * gradients._PIECE // 16 + 5, 16)  # 3+ pieces
        self.empty = nn.Linear(0, 4)  # weight of 0 elements, bias of 4
        self.mixed = nn.Linear(4, 4)
        self.mixed.bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)


def fill_gradients(model: nn.Module, seed: int = 0) -> None:
    """Random gradients laid out as autograd lays them: like their parameter (a
    channels_last weight gets a channels_last gradient)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        grad = torch.empty_like(p)
        grad.copy_(torch.randn(p.shape, generator=g))
        p.grad = grad


def reference_bad_layers(table: LayerTable) -> set[str]:
    bad = set()
    for p, layer in zip(table.params, table.param_layer):
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad.add(table.layers[layer].name)
    return bad


def checked_bad_layers(norms: GradientNorms, table: LayerTable) -> set[str]:
    (values,), seen = norms.layer_checks()
    assert values.dtype == torch.float32 and values.shape == (len(table),)
    return {table.layers[i].name for i, v in enumerate(values.tolist()) if not math.isfinite(v)}


PLACES = [
    ("a", "weight", (1, 2)),
    ("fp16", "weight", (0, 0)),
    ("brain", "bias", (3,)),
    ("(root)", "temperature", ()),
    ("big", "weight", (-1, 15)),
    ("empty", "bias", (0,)),
    ("mixed", "bias", (2,)),
    ("mixed", "weight", (0, 1)),
    ("conv", "weight", (3, 2, 1, 0)),
]


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"]
)
@pytest.mark.parametrize("layer, param, where", PLACES, ids=[f"{a}.{b}" for a, b, _ in PLACES])
def test_a_non_finite_gradient_is_found_in_its_layer_only(
    accelerator_path, layer, param, where, value
):
    model = Awkward()
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    assert checked_bad_layers(norms, table) == set() == reference_bad_layers(table)
    owner = model if layer == "(root)" else getattr(model, layer)
    getattr(owner, param).grad[where] = value
    assert checked_bad_layers(norms, table) == {layer} == reference_bad_layers(table)


def test_large_finite_fp16_gradients_are_not_an_overflow(accelerator_path):
    """An fp16 layer whose gradients add up far past 65504 is finite (x - x is summed, not
    x); a bf16 one sums in its own range, float32's."""
    model = Awkward()
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    for p in (*model.fp16.parameters(), *model.brain.parameters()):
        p.grad.fill_(60000.0)
    assert checked_bad_layers(norms, table) == set()


def test_the_plan_follows_frozen_layers_a_cast_and_a_move(accelerator_path):
    """The cached plan is rebuilt when the set of gradients, a dtype or a shape changes."""
    model = Awkward()
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    model.a.weight.grad = None  # a frozen weight
    model.fp16.weight.grad[0, 0] = float("nan")
    assert checked_bad_layers(norms, table) == {"fp16"} == reference_bad_layers(table)
    _, seen = norms.layer_checks()
    assert table.names.index("a") in seen  # its bias still has a gradient
    model.a.bias.grad = None
    _, seen = norms.layer_checks()
    assert table.names.index("a") not in seen
    model.float()  # every parameter cast after the plan was made
    fill_gradients(model, seed=1)
    model.mixed.weight.grad[1, 1] = float("inf")
    assert checked_bad_layers(norms, table) == {"mixed"} == reference_bad_layers(table)
    model.a.weight.data = torch.randn(4, 6)  # the same parameter, another shape
    fill_gradients(model, seed=2)
    model.a.weight.grad[3, 5] = float("nan")
    assert checked_bad_layers(norms, table) == {"a"} == reference_bad_layers(table)
    assert checked_bad_layers(norms, table) == {"a"}


@pytest.mark.parametrize(
    "budget", [64, 4096], ids=["every gradient summed where it lies", "small copies"]
)
def test_chunks_bound_the_copy_and_find_the_same_layers(accelerator_path, monkeypatch, budget):
    """With a copy budget smaller than the gradients, a gradient that large is summed where it
    lies (a view: no copy, never written) and the rest are copied a budget at a time: more
    ops, the same answer."""
    monkeypatch.setattr(gradients, "_CHUNK_BYTES", budget)
    model = Awkward()
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    model.brain.weight.grad[2, 2] = float("nan")
    model.big.weight.grad[7, 3] = float("inf")
    model.fp16.bias.grad[1] = float("nan")
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert (
        checked_bad_layers(norms, table) == {"brain", "big", "fp16"} == reference_bad_layers(table)
    )
    for name, p in model.named_parameters():  # the check reads the gradients, never writes them
        assert torch.equal(p.grad.nan_to_num(), before[name].nan_to_num()), name


def test_a_plan_without_the_fused_check_is_made_again_on_a_move_or_a_cast(
    accelerator_path, monkeypatch
):
    """A model stepped where the fused check does not run, then moved or cast to where it
    does, gets it from then on: the plan without it also looks at the first gradient's
    device and dtype every step. (A move to CUDA is emulated by a cast: this machine has one
    device; a device without the check by leaving the CPU out of _FUSED_DEVICES.)"""
    monkeypatch.setattr(gradients, "_FUSED_DEVICES", ("cuda",))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    (values,), _ = norms.layer_checks()
    assert values.dtype == torch.float64  # exact squares: no fused check here
    monkeypatch.setattr(gradients, "_FUSED_DEVICES", ("cuda", "cpu"))
    model.double()  # the same parameters, cast
    fill_gradients(model)
    model[1].bias.grad[0] = float("inf")
    (values,), _ = norms.layer_checks()
    assert values.dtype == torch.float32  # the fused check's
    assert [math.isfinite(v) for v in values.tolist()] == [True, False]


def test_a_device_without_a_segmented_sum_gets_the_exact_squares(accelerator_path, monkeypatch):
    """segment_reduce has CPU and CUDA kernels only: elsewhere (MPS) the check falls back to
    the sampled steps' reduction instead of failing at every step."""
    monkeypatch.setattr(gradients, "_FUSED_DEVICES", ("cuda",))
    model = nn.Linear(4, 4)
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    model.weight.grad[0, 0] = float("nan")
    (values,), _ = norms.layer_checks()
    assert values.dtype == torch.float64 and not math.isfinite(float(values[0]))


def test_one_check_makes_a_handful_of_ops_and_no_hidden_read():
    """Ops and output tensors of one check do not grow with the number of gradients; the
    segmented reduction is told its lengths are valid (its safe mode reads their sum and
    minimum back to the host: two waits for a GPU on every step)."""

    def counted(n_layers: int) -> tuple[OpCounter, int]:
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n_layers)))
        table = LayerTable(model)
        norms = GradientNorms(table)
        norms.cpu_dot_per_tensor = False
        fill_gradients(model)
        norms.layer_checks()  # the plan, made once
        with OpCounter() as counter:
            norms.layer_checks()
        return counter, len(table.params)

    small, n_small = counted(2)
    large, n_large = counted(200)
    assert (n_small, n_large) == (4, 400)
    assert small.ops == large.ops and small.outputs == large.outputs
    # the copy, its row, the pieces' sums and their fold into layers (one segment_reduce:
    # the pieces come in layer order)
    assert sum(small.ops.values()) <= 4 and small.outputs <= 4, small.ops
    assert small.ops["aten._chunk_cat.default"] == 1
    assert "aten.index_add_.default" not in small.ops
    assert [kw.get("unsafe") for kw in small.kwargs_of["aten.segment_reduce.default"]] == [
        True,
        True,
    ]


def test_the_cpu_path_and_distributed_gradients_fall_back_to_exact_squares():
    model = nn.Linear(4, 4)
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    (checks,), _ = norms.layer_checks()  # a CPU: one BLAS dot per gradient, exact squares
    expected = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    assert checks.dtype == torch.float64 and float(checks[0]) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", ["first", "after the frozen ones", "last"])
def test_one_chunk_folds_into_layers_around_layers_without_gradients(accelerator_path, bad):
    """The usual model (one dtype, one copy): its pieces fold into layers by a second
    segmented sum, where a layer without gradients is an empty segment (its value 0, finite)
    and a gradient larger than one piece spans several pieces of its layer."""
    model = nn.Sequential(*(nn.Linear(300, 300) for _ in range(6)))  # 90,000: two pieces
    table = LayerTable(model)
    norms = GradientNorms(table)
    fill_gradients(model)
    for p in (*model[1].parameters(), *model[2].parameters()):
        p.grad = None  # frozen
    target = {"first": model[0], "after the frozen ones": model[3], "last": model[5]}[bad]
    target.weight.grad[299, 299] = float("nan")  # in the weight's second piece
    with OpCounter() as counter:
        assert checked_bad_layers(norms, table) == reference_bad_layers(table)
    assert len(reference_bad_layers(table)) == 1
    assert "aten.index_add_.default" not in counter.ops
    assert counter.ops["aten.segment_reduce.default"] == 2  # the pieces, then the layers
