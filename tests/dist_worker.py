"""Body of one rank for test_distributed (a module of its own so spawn can import it)."""

from __future__ import annotations

import os


def run_rank(rank: int, world: int, master_port: int, base_port: int, steps: int, out, go_home):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookprof
    from models import DeepNet, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        prof = hookprof.attach(model, port=base_port, sample_every=1, min_sample_interval_s=0.0)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(steps):
            x, y = model.batch(g)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
        out.put((rank, prof.url, {n: s.grad_norm for n, s in snap.layers.items()}))
        go_home.wait(60)  # the parent scrapes while we are still serving
        prof.detach()
    finally:
        dist.destroy_process_group()
