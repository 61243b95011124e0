"""Models and loops the tests train. Small, deterministic on CPU."""

from __future__ import annotations

import torch
from torch import nn


class MixedNet(nn.Module):
    """The awkward cases in one model: Embedding, LSTM, MultiheadAttention (owns
    in_proj_weight, never calls out_proj), a Linear shared by two calls, in-place ReLU."""

    def __init__(self, vocab: int = 50, dim: int = 32, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.shared = nn.Linear(dim, dim)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(dim, classes)
        self.vocab, self.classes = vocab, classes

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x, _ = self.lstm(x)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = x + a
        x = self.act(self.shared(x))
        x = self.act(self.shared(x))  # the same module, called a second time
        return self.head(x.mean(dim=1))

    def batch(self, g: torch.Generator, size: int = 8, seq: int = 12):
        tokens = torch.randint(0, self.vocab, (size, seq), generator=g)
        return tokens, tokens.sum(dim=1) % self.classes


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class DeepNet(nn.Module):
    """stem -> blocks.0..n-1 (fc, act) -> head: layer order is known, for NaN localisation."""

    def __init__(self, dim: int = 16, depth: int = 5):
        super().__init__()
        self.stem = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def batch(self, g: torch.Generator, size: int = 16):
        x = torch.randn(size, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True)

    def order(self) -> list[str]:
        names = ["stem"]
        for i in range(len(self.blocks)):
            names += [f"blocks.{i}.fc", f"blocks.{i}.act"]
        return names + ["head"]


class Generator(nn.Module):
    """A GAN's generator: noise (4) -> sample (8)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    """A GAN's discriminator: sample (8) -> logit."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


class ReplayCheckNet(nn.Module):
    """Dropout (RNG), BatchNorm (buffers a replay must put back), and plain layers: the
    replay check's tests (tests/behaviour/test_replay_check.py)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.drop(self.act(self.bn(self.fc1(x)))))))


class DirectForwardNet(nn.Module):
    """A layer called through `.forward()`, not `__call__` (hookprof's hooks wrap `forward`:
    a forward hook would not see that call)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1.forward(x)))


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    inputs, target = batch
    out = model(inputs)
    if target.dtype == torch.long:
        return nn.functional.cross_entropy(out, target)
    return nn.functional.mse_loss(out, target)


def train(
    model: nn.Module,
    steps: int,
    *,
    prof=None,
    seed: int = 0,
    lr: float = 0.05,
    explicit_step: bool = False,
    micro_batches: int = 1,
    on_step=None,
):
    """SGD with momentum; optimizer steps end hookprof steps unless explicit_step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            loss = loss_of(model, model.batch(g)) / micro_batches
            loss.backward()
        if on_step is not None:
            on_step(step, model)
        opt.step()
        if explicit_step and prof is not None:
            prof.step(loss)
        losses.append(loss.detach())
    return losses


def scaler_loop(model, opt, steps: int, overflow_at: set[int], on_step=None) -> int:
    """fp16 autocast + GradScaler; the scaled gradients overflow at `overflow_at`. Returns
    how many steps the scaler itself skipped (its scale went down), counted apart."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(0)
    skipped = 0
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, model.batch(g))
        if step in overflow_at:
            loss = loss * 1e38
        scaler.scale(loss).backward()
        if on_step is not None:
            on_step(step, scaler.get_scale())
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    return skipped


def mse_step(forward, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One plain training iteration (MSE loss, backward, optimizer step); returns the loss.
    `forward` is the model or a wrapper of it (DDP)."""
    loss = nn.functional.mse_loss(forward(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def seeded(cls, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return cls(**kwargs)


def profiled(model: nn.Module, steps: int, settings: dict, **train_kwargs):
    """Train `model` for `steps` with hookprof attached (Config overrides `settings`) and
    return the snapshot after everything was folded in. The profiler is detached."""
    import hookprof

    with hookprof.attach(model, **settings) as prof:
        train(model, steps, prof=prof, **train_kwargs)
        prof.flush()
        return prof.snapshot()


def run_optionally_profiled(
    model: nn.Module, settings: dict | None, steps: int, train_step, *, scrape_metrics: bool = False
):
    """Call `train_step()` (one training iteration; returns its loss) `steps` times, with
    hookprof attached (Config overrides `settings`; each iteration ends with prof.step(loss))
    or, when settings is None, without it. Returns (profiler, snapshot after everything was
    folded in, /metrics text if asked), or Nones without hookprof. Always detaches."""
    import hookprof
    from support.metrics import scrape

    prof = hookprof.attach(model, **settings) if settings is not None else None
    try:
        for _ in range(steps):
            loss = train_step()
            if prof is not None:
                prof.step(loss)
        if prof is None:
            return None, None, None
        prof.flush()
        return prof, prof.snapshot(), scrape(prof.url) if scrape_metrics else None
    finally:
        if prof is not None:
            prof.detach()


def layer_norms(model: nn.Module) -> dict[str, float]:
    """{qualified name: L2 norm of that module's own parameters' gradients}, computed apart
    from hookprof (in float64) from whatever `.grad` holds now; modules without gradients are
    left out, as hookprof leaves their grad_norm at None."""
    norms = {}
    for name, module in model.named_modules():
        grads = [
            p.grad.double().flatten()
            for p in module.parameters(recurse=False)
            if p.grad is not None
        ]
        if grads:
            norms[name] = torch.linalg.vector_norm(torch.cat(grads)).item()
    return norms


def hookprof_norms(prof) -> tuple[int, int | None, dict[str, float]]:
    """hookprof's view of the step that just ended: (steps counted, last sampled step,
    {layer: gradient norm} for the layers that have one). Flushes first, so it is current."""
    prof.flush()
    snap = prof.snapshot()
    norms = {name: s.grad_norm for name, s in snap.layers.items() if s.grad_norm is not None}
    return snap.step, snap.last_sampled_step, norms
