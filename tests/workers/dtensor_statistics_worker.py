"""Per-layer statistics on FSDP2 (DTensor) parameters, in a process of its own: one rank of a
gloo group on the CPU (a process group is global state, kept out of the test process). Prints
one JSON line: the sampled steps, the internal errors, the parameter statistic's
values, what the test computes from the local shards, and the layers with a gradient norm.

    python dtensor_statistics_worker.py MASTER_PORT
"""

from __future__ import annotations

import json
import sys

from support.ranks import torchrun_environment


class WeightRMS:
    """docs' recipe (step/statistics.py): reads plain tensors, the rank's shards."""

    name = "weight_rms"
    help = "Root mean square of the layer's parameters after the last sampled update"
    source = "parameters"

    def reduce(self, parameters):
        squares = sum(p.float().pow(2).sum() for p in parameters)
        return (squares / sum(p.numel() for p in parameters)).sqrt()


class ReturnsDTensor:
    """An output statistic that hands back a DTensor (a tensor-parallel output reduced as is)."""

    name = "returns_dtensor"
    help = "A statistic whose value is a DTensor"

    def __init__(self, mesh):
        self.mesh = mesh

    def reduce(self, output):
        from torch.distributed.tensor import Replicate, distribute_tensor

        return distribute_tensor(output.float().mean().reshape(1), self.mesh, [Replicate()])


def main() -> None:
    torchrun_environment(0, 1, int(sys.argv[1]))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hookprof

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        for m in (model[0], model[2]):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = hookprof.attach(
            model,
            layer_statistics=(WeightRMS(), ReturnsDTensor(mesh)),
            port=0,
            sample_every=1,
            min_sample_interval_s=0.0,
            activation_interval_s=0.0,
            summary_at_exit=False,
            flop_counting=False,
        )
        try:
            for _ in range(3):
                loss = model(torch.randn(16, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.step(loss)
            prof.flush()
            snap = prof.snapshot()
        finally:
            prof.detach()
        expected = {
            name: float(
                torch.cat([p.to_local().detach().reshape(-1) for p in m.parameters()])
                .pow(2)
                .mean()
                .sqrt()
            )
            for name, m in model.named_children()
            if list(m.parameters())
        }
        print(
            json.dumps(
                {
                    "param_type": type(model[0].weight).__name__,
                    "sampled_steps": snap.sampled_steps,
                    "errors": snap.internal_errors,
                    "weight_rms": dict(snap.layer_statistics["weight_rms"].values),
                    "expected": expected,
                    "returns_dtensor": dict(snap.layer_statistics["returns_dtensor"].values),
                    "grad_norms": sorted(n for n, s in snap.layers.items() if s.grad_norm),
                }
            )
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
