"""A small model trained on synthetic data, for `hookprof demo` and the tests."""

from __future__ import annotations

import torch
from torch import nn


class DemoNet(nn.Module):
    """Embedding -> self-attention -> MLP -> classifier: the layer kinds of a transformer."""

    def __init__(self, vocab: int = 64, dim: int = 64, classes: int = 8, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)
        self.classes = classes
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (batch, seq, dim)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm(x + a)
        x = x + self.mlp(x)
        return self.head(x.mean(dim=1))  # (batch, classes)

    def batch(self, generator: torch.Generator, size: int = 32, seq: int = 16):
        """Tokens and a label the model can learn: the token sum modulo the class count."""
        tokens = torch.randint(0, self.vocab, (size, seq), generator=generator)
        return tokens, tokens.sum(dim=1) % self.classes


class InjectNonFinite:
    """A forward hook (user code, not hookprof) that makes one layer's output NaN or Inf: how
    the demo and the tests make a known layer go bad at a known step.

    By default it counts the module's calls and fires on the calls in `at`. With
    `count_calls=False` the caller sets `.step` each training step and it fires while `.step`
    is in `at`, so a replay of that step (hookprof's localisation) reproduces it."""

    def __init__(
        self, module: nn.Module, at: set[int], value: float = float("nan"), count_calls: bool = True
    ):
        self.step = 0
        self.at = set(at)
        self.value = value
        self.count_calls = count_calls
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.count_calls:
            self.step += 1
        if self.step in self.at:
            return output + self.value  # stays in the graph, so gradients turn bad too
        return None

    def remove(self) -> None:
        self.handle.remove()
