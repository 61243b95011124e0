"""Body of one rank for test_layer_stragglers (a module of its own so spawn can import it):
a rank of a 3-rank DDP job over gloo on the CPU whose `blocks.2.fc` takes a fixed time per
call in its forward and in its backward (a stand-in for a layer's compute, which DeepNet's
16-wide layers are too small to show), one rank taking longer in one of them, as a slow GPU
or a throttled core would in one layer. The ranks train until told to stop, and stop after
the same step (rank 0 names it a few steps ahead)."""

from __future__ import annotations

import time

from support.ranks import torchrun_environment, train_in_step

LAYER_SECONDS = 0.002  # each rank's blocks.2.fc per call, forward and backward alike


def slow_linear(linear, forward_s: float, backward_s: float):
    """`linear` (an nn.Linear) whose forward takes `forward_s` more (inside its own call) and
    whose backward `backward_s` more (a custom autograd function on its output, so the time
    falls inside the layer's backward span)."""
    import torch
    from torch import nn

    class SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(backward_s)
            return grad

    class SlowLinear(nn.Linear):
        def forward(self, x):
            time.sleep(forward_s)
            return SleepInBackward.apply(super().forward(x))

    slow = SlowLinear(linear.in_features, linear.out_features)
    slow.load_state_dict(linear.state_dict())
    return slow


def run_rank(rank, world, master_port, base_port, extra, out, go_home, stop_at):
    """extra[rank]: (forward, backward) seconds this rank's blocks.2.fc takes on top of
    LAYER_SECONDS."""
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        more_forward, more_backward = extra[rank]
        model.blocks[2].fc = slow_linear(
            model.blocks[2].fc, LAYER_SECONDS + more_forward, LAYER_SECONDS + more_backward
        )
        ddp = DDP(model)
        prof = hookprof.attach(
            model, port=base_port, min_sample_interval_s=0.1, system_metrics=False
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        mse_step(ddp, opt, *model.batch(g))
        prof.step()
        out.put((rank, prof.url))

        def one_step():
            mse_step(ddp, opt, *model.batch(g))
            prof.step()

        train_in_step(rank, go_home, stop_at, one_step, deadline_s=150)
        prof.detach()
    finally:
        dist.destroy_process_group()
