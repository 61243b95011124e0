"""Two ranks (torch.distributed, gloo, CPU): each serves base_port + LOCAL_RANK with its own
rank label, and DDP's gradients are read after the all-reduce."""

from __future__ import annotations


import pytest
import torch.multiprocessing as mp

from conftest import free_port, parse, samples, scrape
from dist_worker import run_rank

pytestmark = pytest.mark.slow


def test_two_ranks_serve_two_ports_with_rank_labels():
    ctx = mp.get_context("spawn")
    out, go_home = ctx.Queue(), ctx.Event()
    base_port, master_port, steps = free_port(), free_port(), 4
    procs = [
        ctx.Process(target=run_rank, args=(r, 2, master_port, base_port, steps, out, go_home))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            rank, url, norms = out.get(timeout=120)
            results[rank] = (url, norms)
        texts = {rank: scrape(url) for rank, (url, _) in results.items()}
    finally:
        go_home.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0, 0]

    assert results[0][0].endswith(f":{base_port}/metrics")
    assert results[1][0].endswith(f":{base_port + 1}/metrics")
    for rank, text in texts.items():
        f = parse(text)
        assert samples(f, "hookprof_steps", "hookprof_steps_total") == {
            frozenset({"rank": str(rank)}.items()): steps
        }
        layer_ranks = {dict(k)["rank"] for k in samples(f, "hookprof_layer_gradient_norm")}
        assert layer_ranks == {str(rank)}
    # different data per rank, identical gradients after DDP's all-reduce
    assert results[0][1] == results[1][1]
    with_params = {n: v for n, v in results[0][1].items() if not n.endswith(".act")}
    assert with_params and all(v > 0 for v in with_params.values())
