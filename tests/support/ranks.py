"""torch.distributed ranks on the CPU (gloo), each a spawned process: the environment
torchrun would give a rank, starting two ranks and scraping each, and joining them (or
killing those that hang). The rank bodies themselves are in tests/workers/."""

from __future__ import annotations

import os

from support.metrics import scrape
from support.ports import free_port, free_port_range


def torchrun_environment(rank: int, world: int, master_port: int, **extra: str) -> None:
    """What torchrun would set for this rank (and `extra` variables), in this process."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        **extra,
    )


def join_or_kill(procs, timeout: float = 30) -> None:
    """Wait for the rank processes to leave; kill (by their handle) those that do not."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_two(target, steps):
    """Two ranks running `target(rank, 2, master_port, base_port, steps, out, go_home)`; each
    puts (rank, url, ...) on `out` and serves until told to go home. Returns ({rank: what it
    put after its rank}, {rank: its /metrics page}, base_port); both must exit cleanly."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, go_home = ctx.Queue(), ctx.Event()
    master_port = free_port()
    base_port = free_port_range(2, avoid=(master_port,))
    procs = [
        ctx.Process(target=target, args=(r, 2, master_port, base_port, steps, out, go_home))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            item = out.get(timeout=180)
            results[item[0]] = item[1:]
        texts = {rank: scrape(r[0]) for rank, r in results.items()}
    finally:
        go_home.set()
        join_or_kill(procs)
    assert [p.exitcode for p in procs] == [0, 0]
    return results, texts, base_port


def train_in_step(rank: int, go_home, stop_at, one_step, *, deadline_s: float = 120.0) -> None:
    """Run `one_step()` until the parent says go home (`go_home`, an Event), every rank
    stopping after the same step, or one would wait forever in a collective: rank 0 names
    that step in `stop_at` (a shared int, 0 until then) a few steps ahead, which the others, at
    most one step off, read in time. Bounded by `deadline_s` whatever the parent does."""
    import time

    deadline = time.monotonic() + deadline_s
    step = 1
    while stop_at.value == 0 or step < stop_at.value:
        if rank == 0 and stop_at.value == 0 and (go_home.is_set() or time.monotonic() > deadline):
            stop_at.value = step + 3
        one_step()
        step += 1
