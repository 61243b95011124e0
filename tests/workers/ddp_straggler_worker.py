"""Body of one rank for test_ddp_stragglers and bench/straggler_wait_phase.py (a module of its
own so spawn can import it): a rank of a job whose ranks synchronise every step (DDP, or
FSDP2, over gloo on the CPU) that trains until told to stop, one rank slowed down in one
phase. The fast ranks wait for the slow one in a collective; which step phase holds that
wait depends on the set-up (SETUPS)."""

from __future__ import annotations

import time

from support.ranks import torchrun_environment, train_in_step

# name -> what differs; "ddp" is the plain case the test runs
SETUPS = {
    "ddp": "DDP(model), hookprof attached to the model inside it, no buffers",
    "ddp+buffers": "the model holds a buffer (as BatchNorm does): DDP broadcasts buffers at the start of "
    "its forward, before the wrapped model's forward",
    "ddp+buffers, attached to the wrapper": "the same, hookprof attached to the DDP wrapper itself",
    "ddp+buffers, broadcast_buffers=False": "the same buffer, DDP told not to broadcast buffers",
    "fsdp": "fully_shard on each block and the root (FSDP2), hookprof attached after sharding",
}


def _wrapped(model, setup: str, world: int):
    """(what the loop calls, what hookprof attaches to) for one set-up."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if setup == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # said explicitly: the default mesh is on CUDA
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    if "buffers" in setup:
        model.register_buffer("running_scale", torch.ones(4))
    ddp = DDP(model, broadcast_buffers="broadcast_buffers=False" not in setup)
    return ddp, (ddp if "wrapper" in setup else model)


def run_rank(
    rank: int,
    world: int,
    master_port: int,
    base_port: int,
    delays,
    slow_phase: str,
    out,
    go_home,
    stop_at,
    setup: str = "ddp",
):
    """delays[rank]: seconds of sleep per step in `slow_phase` ("data": before the forward,
    as a slow data loader; "forward": inside the model's forward, as a slow layer; "other":
    after the optimizer step, as rank 0 logging or checkpointing).
    go_home (an Event) asks to stop; the ranks must then stop after the same step, or one
    would wait forever in a collective: rank 0 names that step in stop_at (a shared int, 0
    until then) a few steps ahead, which the others, at most one step off, read in time."""
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        if slow_phase == "forward":  # runs inside the root's forward, whatever wraps the model
            model.stem.register_forward_pre_hook(lambda module, args: time.sleep(delays[rank]))
        train, attached = _wrapped(model, setup, world)
        prof = hookprof.attach(
            attached, port=base_port, min_sample_interval_s=0.2, system_metrics=False
        )
        opt = torch.optim.SGD(train.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        mse_step(train, opt, *model.batch(g))
        prof.step()
        out.put((rank, prof.url))

        def one_step():
            batch = model.batch(g)
            if slow_phase == "data":
                time.sleep(delays[rank])  # the slowed rank's data loader
            mse_step(train, opt, *batch)
            if slow_phase == "other":
                time.sleep(delays[rank])  # the slowed rank's logging after the update
            prof.step()  # the step ends here: the time since the update is `other`

        train_in_step(rank, go_home, stop_at, one_step)
        prof.detach()
    finally:
        dist.destroy_process_group()
