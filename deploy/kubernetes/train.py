"""An example training script for the Kubernetes Job (deploy/kubernetes/training-job.yaml):
DDP over torchrun with hookprof attached in one line. Runs anywhere torchrun does: NCCL with
one GPU per local rank, else gloo on the CPU (a node with fewer GPUs than ranks says so once).

    torchrun --standalone --nproc-per-node=2 train.py --steps 1000

Each rank serves /metrics on HOOKPROF_PORT + LOCAL_RANK (set HOOKPROF_ADDR=0.0.0.0 in a pod
so that Prometheus can reach it).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hookprof


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # every rank of a node decides alike: NCCL needs a GPU of its own per rank
    cuda = gpus >= local_world
    if 0 < gpus < local_world and local_rank == 0:
        print(
            f"train.py: {gpus} GPU(s) for {local_world} local ranks: training on the CPU with gloo",
            flush=True,
        )
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    model = nn.Sequential(
        nn.Linear(args.width, args.width),
        nn.GELU(),
        nn.Linear(args.width, args.width),
        nn.GELU(),
        nn.Linear(args.width, 10),
    ).to(device)
    prof = hookprof.attach(model)  # before DDP wraps it: hooks belong on the real layers
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    print(f"rank {dist.get_rank()}: metrics at {prof.url}", flush=True)

    generator = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(64, args.width, generator=generator).to(device)
        y = torch.randint(0, 10, (64,), generator=generator).to(device)
        loss = nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        prof.step(loss)

    prof.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
