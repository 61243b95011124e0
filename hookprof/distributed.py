"""Which rank this process is. hookprof never runs collectives of its own."""

from __future__ import annotations

import os
from collections.abc import Mapping


def detect_rank(environ: Mapping[str, str] | None = None) -> int:
    """$RANK (torchrun, SLURM via torchrun), else torch.distributed's rank, else 0."""
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "").strip().isdigit():
        return int(environ["RANK"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def detect_local_rank(environ: Mapping[str, str] | None = None) -> int:
    """$LOCAL_RANK, else 0: each process on a host serves `port + local_rank`."""
    environ = os.environ if environ is None else environ
    value = environ.get("LOCAL_RANK", "").strip()
    return int(value) if value.isdigit() else 0
