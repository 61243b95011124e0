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


def with_other_ranks(environ: Mapping[str, str] | None = None) -> bool:
    """Is this process one rank of several: $WORLD_SIZE above 1 (torchrun sets it before the
    process group exists), or torch.distributed initialized with more than one rank?"""
    environ = os.environ if environ is None else environ
    size = environ.get("WORLD_SIZE", "").strip()
    if size.isdigit() and int(size) > 1:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def detect_local_rank(environ: Mapping[str, str] | None = None) -> int:
    """$LOCAL_RANK, else 0: each process on a host serves `port + local_rank`."""
    environ = os.environ if environ is None else environ
    value = environ.get("LOCAL_RANK", "").strip()
    return int(value) if value.isdigit() else 0
