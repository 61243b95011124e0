"""Body of one rank for test_replica_check_ranks (a module of its own so spawn can import it): a
rank of a DDP job over gloo on the CPU with the replica check on
(Config.sdc_check_interval_s). With `flip_rank` set, that rank flips one bit of one weight
once (the test's own fault: a bit gone wrong in a device's memory), after FLIP_STEP's update
(`in_forward` false) or inside step FLIP_STEP's forward (true: then every step is a check
step, so the flip falls between a check step's forward and its update, the window each rank
watches itself); DDP's identical updates keep the difference from then on. The ranks train
until told to stop, and stop after the same step."""

from __future__ import annotations

import time

from support.ranks import torchrun_environment, train_in_step

FLIP_STEP = 20  # the flip comes after this step's update (before the first check), or in it
FLIPPED = ("blocks.1.fc.weight", (3, 5), 22)  # parameter, element, bit of its float32
EVERY_STEP = 1e-9  # sdc_check_interval_s that makes every step after the first a check step


def run_rank(rank, world, master_port, base_port, flip_rank, in_forward, out, go_home, stop_at):
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        ddp = DDP(model)
        prof = hookprof.attach(
            model,
            port=base_port,
            sdc_check_interval_s=EVERY_STEP if in_forward else 2.0,
            system_metrics=False,
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)  # each replica its own batches
        steps = [0]
        name, element, bit = FLIPPED
        weight = dict(model.named_parameters())[name]

        flipped: list[bool] = []

        def flip() -> None:  # (.data: as memory would, leaving autograd's version counter alone)
            if rank == flip_rank and not flipped:
                weight.data.view(torch.int32)[element] ^= 1 << bit
                flipped.append(True)

        if in_forward:  # inside step FLIP_STEP's forward, after blocks.2 returns
            model.blocks[2].register_forward_hook(
                lambda *_: flip() if steps[0] + 1 == FLIP_STEP else None
            )

        def one_step():
            mse_step(ddp, opt, *model.batch(g))
            prof.step()
            steps[0] += 1
            if not in_forward and steps[0] == FLIP_STEP:
                flip()  # after step FLIP_STEP's update
            if in_forward and steps[0] > FLIP_STEP:
                # every step is a check step: both ranks sit on one for a second, so that
                # scrapes of the two find them at the same step (the replicas' comparison)
                time.sleep(1.0)

        one_step()
        out.put((rank, prof.url))
        train_in_step(rank, go_home, stop_at, one_step, deadline_s=120)
        prof.detach()
    finally:
        dist.destroy_process_group()
