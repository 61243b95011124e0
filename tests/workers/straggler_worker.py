"""Body of one rank for test_stragglers (a module of its own so spawn can import it): a rank
of a torch.distributed (gloo) job that trains until told to stop, one rank slowed down."""

from __future__ import annotations

import time

from support.ranks import torchrun_environment


def run_rank(rank: int, world: int, master_port: int, base_port: int, delays, out, go_home):
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        # no DDP: ranks that all-reduce every step finish every step together, so their step
        # times are equal by construction; these ranks train on, each at its own pace
        prof = hookprof.attach(
            model, port=base_port, min_sample_interval_s=0.2, system_metrics=False
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        mse_step(model, opt, *model.batch(g))
        out.put((rank, prof.url))
        deadline = time.monotonic() + 120  # bounded, whatever the parent does
        while not go_home.is_set() and time.monotonic() < deadline:
            time.sleep(delays[rank])  # the slowed rank: a slow data loader, a slow host
            mse_step(model, opt, *model.batch(g))
        prof.detach()
    finally:
        dist.destroy_process_group()
