"""The four workload shapes of issue 13, written here without new dependencies (transformers'
GPT-2 only when it is importable), for bench/host_cost.py and bench/overhead.py --gpu.

hookprof's host work depends on how many layers and gradient tensors a model has, not on how
wide they are: `full=False` keeps every layer and parameter tensor of each shape and narrows
them (and the batch) so that a 2-core CPU runs a step in milliseconds; `full=True` is the
issue's sizes (for a GPU).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# ---------------------------------------------------------------- ResNet-50 shape


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)  # one module called three times, as in torchvision
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50Shape(nn.Module):
    """torchvision's resnet50 layout: stages of 3, 4, 6, 3 bottlenecks, 161 parameter
    tensors; `width` 64 is the real network."""

    def __init__(self, width: int = 64, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, inplanes = [], width
        for i, blocks in enumerate((3, 4, 6, 3)):
            planes = width * 2**i
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(inplanes, planes, stride=2 if (b == 0 and i > 0) else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---------------------------------------------------------------- GPT-124M shape (nanoGPT)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLPBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTShape(nn.Module):
    """nanoGPT's GPT-2 124M: 12 blocks, tied embedding and head, 148 parameter tensors."""

    def __init__(
        self,
        dim: int = 768,
        heads: int = 12,
        layers: int = 12,
        vocab: int = 50304,
        block: int = 1024,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.h = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------- the workloads


@dataclass
class Shape:
    """One workload: a model, an optimizer, one fixed batch and its loss."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    autocast: torch.dtype | None  # bf16 autocast on CUDA for the convnet and the GPTs

    def step(self, before_update: Callable[[nn.Module], None] | None = None) -> torch.Tensor:
        """One training step: zero_grad, forward (under autocast), backward, update. Nothing
        in it waits for the device."""
        self.optimizer.zero_grad(set_to_none=True)
        device = self.batch[0].device.type
        with torch.autocast(device, dtype=self.autocast, enabled=self.autocast is not None):
            loss = self.loss(self.model, self.batch)
        loss.backward()
        if before_update is not None:
            before_update(self.model)
        self.optimizer.step()
        return loss


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _next_token(model, batch):
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def _hf_loss(model, batch):
    idx, targets = batch
    return model(input_ids=idx, labels=targets).loss


def hf_available() -> bool:
    try:
        importlib.import_module("transformers")
    except Exception:
        return False
    return True


NAMES = ("resnet50", "gpt", "hf-gpt2", "mlp")


def build(
    name: str, device: torch.device, *, full: bool, seed: int = 0, batch_times: int = 1
) -> Shape:
    """The workload `name` on `device`: the issue's sizes when `full`, else narrow ones;
    `batch_times` multiplies the batch (a device-bound variant: more device work per step
    for the same host work, issue 37 item 4)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    cuda = device.type == "cuda"
    bf16 = torch.bfloat16 if cuda else None
    if name == "resnet50":
        width, batch, size = (64, 64, 224) if full else (8, 2, 32)
        batch *= batch_times
        model = ResNet50Shape(width).to(device)
        x = torch.randn(batch, 3, size, size, generator=g).to(device)
        if cuda:
            model, x = (
                model.to(memory_format=torch.channels_last),
                x.to(memory_format=torch.channels_last),
            )
        y = torch.randint(0, 1000, (batch,), generator=g).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        label = f"ResNet-50 shape, width {width}, batch {batch}, {size}x{size}"
        return Shape(label, model, opt, (x, y), _classify, bf16)
    if name in ("gpt", "hf-gpt2"):
        dim, heads, vocab, seq, batch = (768, 12, 50304, 1024, 8) if full else (64, 4, 512, 64, 2)
        batch *= batch_times
        if name == "gpt":
            model = GPTShape(dim, heads, 12, vocab, seq).to(device)
            loss = _next_token
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(
                n_embd=dim,
                n_head=heads,
                n_layer=12,
                vocab_size=vocab,
                n_positions=seq,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
                loss_type="ForCausalLM",
            )
            model = GPT2LMHeadModel(cfg).to(device)
            loss = _hf_loss
        idx = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        targets = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        # fused AdamW where the device has it (the GPT runs used it)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=cuda or None)
        kind = "GPT 124M shape (nanoGPT)" if name == "gpt" else "transformers GPT-2 124M shape"
        return Shape(
            f"{kind}, dim {dim}, batch {batch}x{seq}", model, opt, (idx, targets), loss, bf16
        )
    if name == "mlp":
        width, batch = (1024, 256) if full else (128, 32)
        batch *= batch_times
        layers: list[nn.Module] = []
        for _ in range(24):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers).to(device)
        x = torch.randn(batch, width, generator=g).to(device)
        y = torch.randint(0, width, (batch,), generator=g).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return Shape(
            f"MLP 24 x Linear({width}) + ReLU, fp32, batch {batch}",
            model,
            opt,
            (x, y),
            _classify,
            None,
        )
    raise ValueError(f"unknown workload {name!r}; one of {NAMES}")
