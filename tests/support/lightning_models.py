"""A LightningModule, the callbacks that read both sides, and one DDP rank, for
test_lightning (a module of its own so that spawned ranks can import it).

The independent figures come from Lightning's own hooks: `on_before_optimizer_step` runs
inside the closure that `optimizer.step` calls (lightning/pytorch/plugins/precision/
precision.py, Precision._wrap_closure -> _after_closure), after training_step, zero_grad
and backward and before gradient clipping; hookprof's figures are read after the step, in
`on_train_batch_end`."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.inject import NanAt
from support.models import hookprof_norms, layer_norms

BATCH = 8


class Regressor(L.LightningModule):
    """Sequential(Linear, ReLU, Linear, <middle>, ReLU, Linear), the issue's shape; SGD with
    momentum. training_step calls `self.body`, never `self(...)`, as Lightning models do.

    `before_step[i]` holds the per-layer gradient norms Lightning hands to step i + 1,
    taken in on_before_optimizer_step (before clipping), with their global norm in
    `total_before_step[i]`."""

    def __init__(self, middle: nn.Module | None = None, manual: bool = False, lr: float = 0.05):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(4, 16),
            nn.ReLU(),
            nn.Linear(16, 16),
            middle if middle is not None else nn.Identity(),
            nn.ReLU(),
            nn.Linear(16, 1),
        )
        self.automatic_optimization = not manual
        self.lr = lr
        self.before_step: list[dict[str, float]] = []
        self.total_before_step: list[float] = []
        self.losses: list[
            float
        ] = []  # each training_step's loss, as computed (the test's own sync)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        # manual optimization: backward before the step, a step without a closure
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer):
        self.before_step.append(layer_norms(self))
        grads = [p.grad.double() for p in self.parameters() if p.grad is not None]
        self.total_before_step.append(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads])
            ).item()
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ReadEachStep(L.Callback):
    """hookprof's view after each optimizer step, keyed by Lightning's step count:
    `seen[N] = (hookprof's step count, its last sampled step, {layer: norm})`. `after_step[N]`
    holds the norms of the gradients `.grad` still holds after step N (the optimizer does
    not touch them, and the next zero_grad runs only inside the next closure)."""

    def __init__(self, prof):
        self.prof = prof
        self.seen: dict[int, tuple[int, int | None, dict[str, float]]] = {}
        self.after_step: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 0 or step in self.seen:
            return  # gradient accumulation: this batch ended without an optimizer step
        self.seen[step] = hookprof_norms(self.prof)
        self.after_step[step] = layer_norms(pl_module)


class SetStep(L.Callback):
    """Tells a NanAt layer which step the coming batch belongs to."""

    def __init__(self, layer: NanAt):
        self.layer = layer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.layer.step = trainer.global_step + 1


def loader(batches: int, seed: int = 0) -> DataLoader:
    """`batches` batches of a noisy linear map, in a fixed order; targets scaled up so that
    gradient norms exceed 1 (gradient_clip_val=1.0 must clip)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * BATCH, 4, generator=g)
    y = 5 * x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(batches * BATCH, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def fit(
    module: L.LightningModule,
    steps: int,
    *,
    callbacks=(),
    batches: int | None = None,
    root_dir=None,
    **trainer_kwargs,
) -> L.Trainer:
    """Trainer.fit for `steps` optimizer steps on the CPU, with nothing written or printed
    that the tests do not need."""
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(trainer_kwargs)
    trainer = L.Trainer(
        max_steps=steps, callbacks=list(callbacks), default_root_dir=root_dir, **settings
    )
    trainer.fit(module, loader(batches if batches is not None else steps))
    return trainer


def seeded_regressor(**kwargs) -> Regressor:
    torch.manual_seed(0)
    return Regressor(**kwargs)


def run_ddp_rank(rank: int, world: int, master_port: int, base_port: int, steps: int, out, go_home):
    """One of `world` ranks of Trainer.fit(strategy="ddp") over gloo, launched as torchrun
    launches it (TORCHELASTIC_RUN_ID set, so Lightning starts no processes of its own), with
    hookprof attached to the LightningModule exactly as in a single-process script (on a
    free port of its own: base_port, part of run_two's signature, is not used)."""
    from support.ranks import torchrun_environment

    torchrun_environment(
        rank,
        world,
        master_port,
        TORCHELASTIC_RUN_ID="hookprof-test",
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
    )
    import hookprof

    model = seeded_regressor()
    prof = hookprof.attach(model, port=0, sample_every=1, min_sample_interval_s=0.0)
    try:
        reader = ReadEachStep(prof)
        # the DistributedSampler Lightning puts in gives each rank its own half of the batches
        fit(
            model,
            steps,
            callbacks=[reader],
            batches=world * steps,
            strategy="ddp",
            devices=world,
            num_nodes=1,
        )
        out.put((rank, prof.url, model.before_step, reader.seen))
        go_home.wait(60)  # the parent scrapes while we are still serving
    finally:
        prof.detach()
