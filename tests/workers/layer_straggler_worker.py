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
STAGGER_S = 0.010  # on one shared GPU: more than a rank's device work per step (~5-6 ms)


def cycles_per_second() -> float:
    """The GPU's clock cycles per second as `torch.cuda._sleep` counts them (a kernel that
    spins for so many cycles), measured with CUDA events. Measured once, in the test's own
    process before the ranks start: ranks that measured it each while sharing the GPU would
    each read another figure."""
    import statistics

    import torch

    torch.cuda._sleep(400_000_000)  # (~0.2 s at full clock: out of the idle clock first)
    cycles, found = 50_000_000, []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        found.append(cycles / (start.elapsed_time(end) / 1e3))
    return statistics.median(found)


def device_wait(per_second: float | None):
    """A wait of so many seconds where the layer's time is measured: the host's on the CPU
    (`per_second` None: time.sleep), the device's on CUDA (`torch.cuda._sleep` for so many
    seconds of `per_second` cycles; the host does not wait)."""
    if per_second is None:
        return time.sleep
    import torch

    return lambda seconds: torch.cuda._sleep(int(seconds * per_second))


def slow_linear(linear, forward_s: float, backward_s: float, per_second: float | None = None):
    """`linear` (an nn.Linear) whose forward takes `forward_s` more (inside its own call) and
    whose backward `backward_s` more (a custom autograd function on its output, so the time
    falls inside the layer's backward span); on CUDA (`per_second` given), device time."""
    import torch
    from torch import nn

    wait = device_wait(per_second)

    class SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            wait(backward_s)
            return grad

    class SlowLinear(nn.Linear):
        def forward(self, x):
            wait(forward_s)
            return SleepInBackward.apply(super().forward(x))

    slow = SlowLinear(linear.in_features, linear.out_features)
    slow.load_state_dict(linear.state_dict())
    return slow


def run_rank(rank, world, master_port, base_port, extra, out, go_home, stop_at, per_second=None):
    """extra[rank]: (forward, backward) seconds this rank's blocks.2.fc takes on top of
    LAYER_SECONDS. `per_second` (the GPU's, `cycles_per_second`): every rank on the one GPU
    (gloo all-reduces CUDA tensors through the host), the layer's times the device's."""
    device = "cpu" if per_second is None else "cuda"
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
            model.blocks[2].fc,
            LAYER_SECONDS + more_forward,
            LAYER_SECONDS + more_backward,
            per_second,
        )
        model.to(device)
        ddp = DDP(model, device_ids=[0] if device == "cuda" else None)
        prof = hookprof.attach(
            model, port=base_port, min_sample_interval_s=0.1, system_metrics=False
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)

        def batch():
            return [t.to(device) for t in model.batch(g)]

        mse_step(ddp, opt, *batch())
        prof.step()
        out.put((rank, prof.url))

        def one_step():
            if device == "cuda":
                # the ranks share the GPU: each starts its step's device work STAGGER_S after
                # the rank before it, so that their kernels do not run at once (a kernel
                # time-sliced with another's would have the other's time in its span)
                time.sleep(rank * STAGGER_S)
            mse_step(ddp, opt, *batch())
            prof.step()

        train_in_step(rank, go_home, stop_at, one_step, deadline_s=150)
        prof.detach()
    finally:
        dist.destroy_process_group()
