"""One rank of test_stall_distributed (a module of its own so spawn can import it): DDP over
gloo with torch's flight recorder on; rank `stuck` blocks inside blocks.2.act's forward at
the first step after `go` is set, until `release` is set."""

from __future__ import annotations

import time

from support.ranks import torchrun_environment


def run_rank(rank: int, world: int, master_port: int, base_port: int, stuck: int, out, go, release):
    torchrun_environment(rank, world, master_port, TORCH_FR_BUFFER_SIZE="64")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookprof
    from support.models import DeepNet, seeded
    from support.stalling import Sleeper

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        state = {"armed": False}

        def started(_calls):
            out.put(("stuck", rank, time.time()))

        sleeper = Sleeper(at=-1, release=release, max_s=60.0, started=started)
        model.blocks[2].act = sleeper
        prof = hookprof.attach(
            model,
            port=base_port,
            stall_min_s=1.0,
            stall_factor=5.0,
            stall_warmup_steps=3,
            publish_interval_s=0.2,
        )
        out.put(("serving", rank, prof.url))
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        stop = torch.zeros(1)
        while True:
            if rank == stuck and go.is_set() and not state["armed"]:
                state["armed"] = True
                sleeper.at = sleeper.calls + 1  # this step's forward blocks
            x, y = model.batch(g)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
            # the test's own agreement on when to stop (every rank stops at the same step)
            stop.fill_(1.0 if release.is_set() else 0.0)
            dist.all_reduce(stop)
            if stop.item() == world:
                break
        prof.detach()
    finally:
        dist.destroy_process_group()
