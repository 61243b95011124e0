"""The spike replay's per-layer output sums (step/output_sums.py): what is summed, for whom, and
what is left after."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from hookprof.faults import Faults
from hookprof.layers import LayerTable
from hookprof.step import output_sums
from hookprof.step.output_sums import OutputSums
from hookprof.tensors import output_checksum
from support.hooks_left import MODULE_HOOK_DICTS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.hooked = nn.Tanh()

    def forward(self, x):
        return self.hooked(self.b(self.a(x) * 2))  # (a's output doubled by the model's own code)


def sums_of(model: nn.Module, run) -> tuple[list[tuple[int, torch.Tensor]], OutputSums]:
    sums = OutputSums(LayerTable(model), model, Faults())
    into: list[tuple[int, torch.Tensor]] = []
    with sums.installed():
        sums.collect(into)
        run()
    return into, sums


def test_each_layer_output_in_call_order_against_the_tests_own_sums():
    torch.manual_seed(0)
    model = Net()
    replaced = []

    def replace(module, args, output):  # a user's hook that replaces the output: it counts
        replaced.append(output + 1)
        return replaced[-1]

    model.hooked.register_forward_hook(replace)
    x = torch.randn(3, 4)
    into, _ = sums_of(model, lambda: model(x))
    a = model.a(x)
    b = model.b(a * 2)
    expected = [
        (0, output_checksum(a)),
        (1, output_checksum(b)),
        (2, output_checksum(replaced[-1])),
    ]
    assert [(row, int(s)) for row, s in into] == [(row, int(s)) for row, s in expected]


def test_another_threads_calls_are_not_summed_and_nothing_is_while_not_collecting():
    model = Net()
    x = torch.randn(3, 4)

    def run():
        other = threading.Thread(target=lambda: model.a(x))
        other.start()
        other.join()
        model.b(x)

    into, sums = sums_of(model, run)
    assert [row for row, _ in into] == [1]
    with sums.installed():
        model(x)  # (not collecting)
    assert len(into) == 1


def test_too_many_calls_stop_the_collection(monkeypatch):
    monkeypatch.setattr(output_sums, "MAX_CALLS", 5)
    model = Net()
    x = torch.randn(3, 4)
    into, sums = sums_of(model, lambda: [model(x) for _ in range(3)])
    assert len(into) == 5 and sums.stop() and not sums.stop()  # (the flag is the collection's)


def test_nothing_is_left_on_the_modules_after():
    model, twin = Net(), Net()
    model.hooked.register_forward_hook(lambda *a: None)
    twin.hooked.register_forward_hook(lambda *a: None)

    def left(m: nn.Module):
        return [
            (n, sorted(vars(c)), [len(getattr(c, d)) for d in MODULE_HOOK_DICTS])
            for n, c in m.named_modules()
        ]

    sums = OutputSums(LayerTable(model), model, Faults())
    with sums.installed():
        assert "forward" in vars(model.a) and len(model.hooked._forward_hooks) == 2
    assert left(model) == left(twin)


# (dtype, shape, transposed): 4- and 8-byte elements summed in their own width; 2-byte ones
# whose bytes pair up read as int32; the rest (odd sizes, transposed) converted to int32
OUTPUTS = [
    (torch.float32, (16, 33), ""),
    (torch.float32, (8, 6), "transposed"),
    (torch.float64, (5, 3), ""),
    (torch.bfloat16, (6, 4), ""),
    (torch.float16, (5, 3), ""),
    (torch.float16, (6, 4), "transposed"),
    (torch.bfloat16, (16, 3), "sliced"),  # (from element 3: its bytes start off int32's grid)
    (torch.complex64, (3, 2), ""),
]


def numpy_checksum(t: torch.Tensor) -> int:
    """The test's own: the wrapping sum of the tensor's elements (pairs of 2-byte ones when
    the tensor lies contiguous in a multiple of 4 bytes) read as integers, modulo the width."""
    if t.is_complex():
        t = torch.view_as_real(t)
    raw = t.contiguous().view(torch.uint8).numpy()
    size = t.element_size()
    pairs = (
        size < 4
        and t.is_contiguous()
        and t.numel() * size % 4 == 0
        and t.storage_offset() * size % 4 == 0
    )
    width = 4 if pairs else max(size, 4)
    ints = raw.view({2: np.int16, 4: np.int32, 8: np.int64}[width if pairs else size])
    modulus = 2 ** (8 * width)
    return int(sum(int(v) for v in ints.ravel())) % modulus


@pytest.mark.parametrize("dtype, shape, how", OUTPUTS)
def test_the_checksum_is_the_tests_own_wrapping_sum_and_sees_every_single_flipped_bit(
    dtype, shape, how
):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 1e4).to(dtype)
    if how == "transposed":
        x = x.t()
    if how == "sliced":
        x = x[1:5]
        assert x.is_contiguous() and x.storage_offset() == 3
    real = torch.view_as_real(x) if x.is_complex() else x  # (a complex one: its parts)
    width = 64 if real.element_size() == 8 else 32
    value = int(output_checksum(x)) % 2**width
    assert value == numpy_checksum(x)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = real.view(ints[real.element_size()])
    for k in range(8 * real.element_size()):
        # (a copy of its storage, laid out as it is: transposed stays transposed, a slice
        # keeps its offset)
        flipped = torch.empty(0, dtype=bits.dtype).set_(
            bits.untyped_storage().clone(), bits.storage_offset(), bits.shape, bits.stride()
        )
        flipped[(1,) * flipped.dim()] ^= torch.tensor(1, dtype=flipped.dtype) << k
        again = flipped.view(real.dtype)
        if x.is_complex():
            again = torch.view_as_complex(again)
        assert again.is_contiguous() == x.is_contiguous()
        assert int(output_checksum(again)) % 2**width != value, k


def test_a_float32_output_is_summed_with_no_copy_of_it():
    """The point of the native width: no int64 transient (bits_sum's is 8 bytes an element)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, 1024)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        output_checksum(x)
    assert max((e.cpu_memory_usage for e in prof.events()), default=0) < 1024


def test_each_output_gradient_in_the_order_the_backward_computes_them():
    """With a GradientSums, each summed output's gradient is summed as the backward brings
    it (the test's own hooks take the gradients; their bits summed here as int32 apart from
    hookprof's checksum); the gradient is unchanged, no hook stays on a parameter, and a
    second backward through the same outputs (retain_graph) makes more sums than hooks."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    sums = OutputSums(LayerTable(model), model, Faults())
    into: list[tuple[int, torch.Tensor]] = []
    grads = output_sums.GradientSums()
    own: list[tuple[str, torch.Tensor]] = []
    with sums.installed():
        sums.collect(into, grads)
        a = model.a(x)
        a.register_hook(lambda g: own.append(("a", g)))
        b = model.b(a * 2)
        b.register_hook(lambda g: own.append(("b", g)))
        out = model.hooked(b)
        sums.stop()
        out.sum().backward(retain_graph=True)
    assert grads.placed == 3 and not grads.broken
    rows = {0: "a", 1: "b"}
    # hooked (row 2) first, then b, then a: the order the backward computed them
    assert [row for row, _ in grads.items] == [2, 1, 0]
    theirs = {name: np.asarray(g.detach()).view(np.int32).sum(dtype=np.int32) for name, g in own}
    for row, total in grads.items[1:]:
        assert int(total) == int(theirs[rows[row]]), rows[row]
    assert int(grads.items[0][1]) == int(
        np.ones((3, 4), dtype=np.float32).view(np.int32).sum(dtype=np.int32)
    )  # (the gradient of a sum is ones)
    reference = Net()
    reference.load_state_dict(model.state_dict())
    reference.zero_grad()
    reference(x).sum().backward()
    assert all(
        torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
    )
    assert all(not p._backward_hooks for p in model.parameters())
    out.sum().backward()  # (a second backward through the same graph)
    assert len(grads.items) == 6 > grads.placed
