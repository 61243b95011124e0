"""The parameters' fingerprint (hookprof/integrity/fingerprint.py), against the test's own
computation with numpy: the weighted wrapping sum of each parameter's bits read as integers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hookprof import tensors
from hookprof.integrity.fingerprint import (
    EXPORTED_BITS,
    changed_parameters,
    combine,
    device_fingerprints,
    halves,
    parameter_change,
    parameter_sums,
    replica_group,
    run_identity,
)
from support.fingerprints import numpy_fingerprint


def fingerprint(params: list[torch.Tensor]) -> int:
    return combine([v for f in device_fingerprints(params, {}) for v in halves(f).tolist()])


def model_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(7, 5, generator=g),
        torch.randn(5, generator=g).to(torch.float16),
        torch.randn(3, 3, generator=g).to(torch.bfloat16),
        torch.randn(4, generator=g, dtype=torch.float64) * 1e300,  # int64 sums wrap
        torch.randn(2, 2, generator=g, dtype=torch.complex64),
        torch.randn(6, 4, generator=g).t(),  # not contiguous
    ]


def test_equals_an_independent_computation():
    params = model_params()
    assert fingerprint(params) == numpy_fingerprint(params)
    assert 0 <= fingerprint(params) < 1 << EXPORTED_BITS


def test_every_single_bit_flip_changes_it():
    params = model_params()
    clean = fingerprint(params)
    for which, p in enumerate(params):
        for bit in range(8 * p.element_size() // (2 if p.is_complex() else 1)):
            flipped = [q.clone() for q in params]
            t = flipped[which]
            t = torch.view_as_real(t) if t.is_complex() else t
            ints = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            ints[np.unravel_index(1, tuple(ints.shape))] ^= torch.tensor(1, dtype=ints.dtype) << bit
            assert fingerprint(flipped) != clean, (which, bit)
            assert fingerprint(flipped) == numpy_fingerprint(flipped)


def test_the_same_bits_give_the_same_value_and_a_swap_of_parameters_does_not():
    params = model_params()
    assert fingerprint([p.clone() for p in params]) == fingerprint(params)
    a, b = torch.randn(10), torch.randn(10)
    assert fingerprint([a, b]) != fingerprint([b, a])  # weighted by position


def test_a_flip_of_the_highest_bits_is_not_multiplied_away():
    """A weight of 4 times a flip of bit 62 is 2^64, 0 modulo 2^64: the weights are odd."""
    params = [torch.zeros(2, dtype=torch.float64) for _ in range(8)]
    clean = fingerprint(params)
    for which in range(8):
        for bit in (61, 62, 63):
            flipped = [p.clone() for p in params]
            flipped[which].view(torch.int64)[0] ^= torch.tensor(
                1 << bit if bit < 63 else -(1 << 63)
            )
            assert fingerprint(flipped) != clean, (which, bit)


def test_the_replica_group_is_the_run_the_layout_and_the_users_group():
    x = [("w", torch.zeros(3, 4)), ("b", torch.zeros(4))]

    def group(params, run="run:a", user=""):
        return replica_group(params, run, user)

    assert group(x) == group([("w", torch.ones(3, 4)), ("b", torch.ones(4))])  # values apart
    assert group(x) != group([("w", torch.zeros(4, 3)), ("b", torch.zeros(4))])
    assert group(x) != group([("w", torch.zeros(3, 4).half()), ("b", torch.zeros(4))])
    assert group(x) != group(x, run="run:b")  # another run of the same model, same job
    assert group(x) != group(x, user="stage1")  # pipeline stages with the same shapes


def test_the_run_is_torchruns_id_else_the_rendezvous_else_the_process_alone():
    assert run_identity({"TORCHELASTIC_RUN_ID": "abc", "MASTER_PORT": "1"}, "p") == "run:abc"
    assert run_identity({"MASTER_ADDR": "n0", "MASTER_PORT": "29500"}, "p") == "rendezvous:n0:29500"
    assert run_identity({}, "host:12:34") == "process:host:12:34"


def test_a_large_tensor_is_summed_in_chunks_to_the_same_value(monkeypatch):
    """A sum to int64 converts its input first, inside the kernel (8 bytes an element: 4x a
    bfloat16 tensor): a tensor of more than BITS_SUM_CHUNK elements goes in chunks, so no
    allocation is larger than a chunk's int64, and the value is the same."""
    big = torch.randn(7, 1001, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = tensors.bits_sum(big).item()
    assert largest_allocation(lambda: tensors.bits_sum(big)) >= big.numel() * 8  # unchunked
    monkeypatch.setattr(tensors, "BITS_SUM_CHUNK", 1000)
    assert largest_allocation(lambda: tensors.bits_sum(big)) <= 1000 * 8
    assert tensors.bits_sum(big).item() == whole
    assert fingerprint([big]) == numpy_fingerprint([big])
    transposed = big.t()  # not contiguous: chunked through a copy of its own width
    assert fingerprint([transposed]) == numpy_fingerprint([transposed])


def largest_allocation(fn) -> int:
    """The largest host allocation (bytes) any op makes while `fn` runs (torch.profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_the_watch_names_the_first_changed_parameter_and_counts_them_all():
    """parameter_sums before and after, compared on the device and read as the publisher
    does: every dtype's single flips found, the first position in the parameters' order."""
    names = [f"p{i}" for i in range(len(model_params()))]
    for flipped in ([], [3], [1, 4], [0, 2, 3]):
        params = model_params()
        before = parameter_sums(params)
        for i in flipped:
            p = params[i]
            bits = p.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()])
            bits.view(-1)[-1] ^= 1  # the lowest bit of the last element
        values = [v for pair in changed_parameters(before, parameter_sums(params)) for v in pair]
        change = parameter_change(9, [float(v) for v in values], names)
        if not flipped:
            assert change is None
        else:
            assert (change.step, change.parameter, change.changed) == (
                9,
                names[flipped[0]],
                len(flipped),
            )


def test_the_watch_sees_changes_that_cancel_in_the_bits_sum():
    """A value added and taken off again through `.data` rounds one element a unit up and
    another a unit down: their bits sum is unchanged (that is how a sharpness-aware step's
    perturbation went uncounted in 2 parameters of 3), their squares' sum is not."""
    params = [torch.linspace(0.5, 0.9, 6), torch.linspace(-2.0, -1.0, 4)]
    blind, before = parameter_sums(params), parameter_sums(params, squares=True)
    bits = params[0].view(torch.int32)
    bits[1] += 1
    bits[4] -= 1
    assert torch.equal(blind[0][1], parameter_sums(params)[0][1])  # (the bits sum alone)
    after = parameter_sums(params, squares=True)
    values = [v for pair in changed_parameters(before, after) for v in pair]
    change = parameter_change(3, [float(v) for v in values], ["a", "b"])
    assert change is not None and (change.parameter, change.changed) == ("a", 1)


@pytest.mark.parametrize("chunk", [None, 3], ids=["whole", "in chunks"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, torch.float32, torch.bfloat16])
def test_the_squares_sum_reads_the_parameter_and_leaves_it_as_it_was(dtype, chunk, monkeypatch):
    """An int64 view of a float64 parameter's bits converts to int64 as itself: the squares
    must be taken of a copy (they were taken in place once, zeroing float64 weights at every
    check step). The value against Python's own integers, modulo 2^64."""
    if chunk is not None:
        monkeypatch.setattr(tensors, "BITS_SUM_CHUNK", chunk)
    p = torch.nn.Parameter(torch.tensor([1.0, 0.5, -2.0, 3e-3, 7.0, -1e-4, 2.5]).to(dtype))
    kept, version = p.detach().clone(), p._version
    total = tensors.bits_square_sum(p)
    assert torch.equal(p.detach(), kept) and p._version == version
    t = torch.view_as_real(kept) if kept.is_complex() else kept
    ints = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    expected = sum(int(v) ** 2 for v in ints.reshape(-1).tolist()) % (1 << 64)
    assert int(total) % (1 << 64) == expected
