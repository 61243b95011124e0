"""Body of one rank for test_distributed (a module of its own so spawn can import it): DDP,
and FSDP2, over gloo."""

from __future__ import annotations

from support.ranks import torchrun_environment


def run_rank(rank: int, world: int, master_port: int, base_port: int, steps: int, out, go_home):
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        prof = hookprof.attach(model, port=base_port, sample_every=1, min_sample_interval_s=0.0)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(steps):
            mse_step(ddp, opt, *model.batch(g))
        prof.flush()
        snap = prof.snapshot()
        out.put((rank, prof.url, {n: s.grad_norm for n, s in snap.layers.items()}))
        go_home.wait(60)  # the parent scrapes while we are still serving
        prof.detach()
    finally:
        dist.destroy_process_group()


def run_fsdp_rank(
    rank: int, world: int, master_port: int, base_port: int, steps: int, out, go_home
):
    """FSDP2 (fully_shard) over gloo: hookprof attached after sharding, so its parameters
    are the DTensor shards; each rank reports its local (partial) norms and the full norms
    computed with collectives by the test itself."""
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = seeded(DeepNet)
        # a CPU mesh, said explicitly: fully_shard's default mesh is on CUDA whenever CUDA is
        # available, and two ranks on a one-GPU machine would ask for cuda:1
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        prof = hookprof.attach(model, port=base_port, sample_every=1, min_sample_interval_s=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            prof.step(mse_step(model, opt, *model.batch(g)))
        prof.flush()
        snap = prof.snapshot()
        # the test's own collectives: full norms, per layer and global
        full_layers = {}
        for layer in prof.table.layers:
            grads = [prof.table.params[i].grad for i in layer.param_indices]
            grads = [gr.full_tensor() for gr in grads if gr is not None]
            if grads:
                full_layers[layer.name] = torch.linalg.vector_norm(
                    torch.cat([gr.reshape(-1) for gr in grads])
                ).item()
        total = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]
        )
        total = total.full_tensor().item() if hasattr(total, "full_tensor") else float(total)
        dtensor = type(next(model.parameters())).__name__
        out.put(
            (
                rank,
                prof.url,
                {n: s.grad_norm for n, s in snap.layers.items()},
                snap.grad_norm,
                full_layers,
                total,
                dtensor,
                snap.step,
            )
        )
        go_home.wait(60)
        prof.detach()
    finally:
        dist.destroy_process_group()


def run_compiled_rank(
    rank: int, world: int, master_port: int, base_port: int, steps: int, out, go_home
):
    """A compiled model (aot_eager) whose forward all-reduces (as hand-written tensor
    parallelism does), sampled every step with activation checks: no rank re-runs its
    forward for the statistics (alone, it would start an all-reduce the others never join),
    and training goes on. Puts (rank, url, the layers' activation abs max, steps)."""
    torchrun_environment(rank, world, master_port)
    import torch
    import torch.distributed as dist
    from torch import nn

    import hookprof

    class AllReduced(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            y = self.fc(x)
            dist.all_reduce(y)
            return self.head(y)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = AllReduced()
        prof = hookprof.attach(
            model,
            port=base_port,
            sample_every=1,
            min_sample_interval_s=0.0,
            activation_interval_s=0.0,
        )
        call = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            opt.zero_grad()
            call(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
        out.put(
            (rank, prof.url, {n: s.activation_abs_max for n, s in snap.layers.items()}, snap.step)
        )
        go_home.wait(60)
        prof.detach()
    finally:
        dist.destroy_process_group()
