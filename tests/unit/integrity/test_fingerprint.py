"""The parameters' fingerprint (hookprof/integrity/fingerprint.py), against the test's own
computation with numpy: the weighted wrapping sum of each parameter's bits read as integers."""

from __future__ import annotations

import numpy as np
import torch

from hookprof.integrity.fingerprint import (
    EXPORTED_BITS,
    combine,
    device_fingerprints,
    halves,
    layout_of,
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


def test_layout_names_shapes_and_dtypes():
    x = [("w", torch.zeros(3, 4)), ("b", torch.zeros(4))]
    assert layout_of(x) == layout_of([("w", torch.ones(3, 4)), ("b", torch.ones(4))])
    assert layout_of(x) != layout_of([("w", torch.zeros(4, 3)), ("b", torch.zeros(4))])
    assert layout_of(x) != layout_of([("w", torch.zeros(3, 4).half()), ("b", torch.zeros(4))])
