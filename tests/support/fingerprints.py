"""The parameters' fingerprint (hookprof/integrity/fingerprint.py) computed again, the test's
own way, for the tests to compare hookprof's with."""

from __future__ import annotations

import numpy as np
import torch

from hookprof.integrity.fingerprint import EXPORTED_BITS

NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def numpy_fingerprint(params: list[torch.Tensor]) -> int:
    """The same definition, written again: each element's bits as a signed integer of its
    width, summed in Python's unbounded integers, weighted by position, modulo 2^64, folded."""
    total = 0
    for i, p in enumerate(params):
        t = p.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        raw = t.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        ints = np.frombuffer(raw, dtype=NP_INT[t.element_size()])
        total += (2 * i + 1) * sum(int(v) for v in ints)
    total %= 1 << 64
    return (total ^ (total >> EXPORTED_BITS)) & ((1 << EXPORTED_BITS) - 1)
