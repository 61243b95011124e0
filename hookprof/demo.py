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
    """A forward hook (user code, not hookprof) that replaces one layer's output with NaN or
    Inf on chosen calls: how the demo and tests make a known layer go bad at a known step."""

    def __init__(self, module: nn.Module, at_calls: set[int], value: float = float("nan")):
        self.calls = 0
        self.at_calls = set(at_calls)
        self.value = value
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls in self.at_calls:
            return output + self.value  # stays in the graph, so gradients turn bad too
        return None

    def remove(self) -> None:
        self.handle.remove()


class InjectAtStep:
    """Like InjectNonFinite, keyed by the training step the caller sets in `.step` rather than
    by call count, so a replay of that step (hookprof's localisation) reproduces it."""

    def __init__(self, module: nn.Module, at_steps: set[int], value: float = float("nan")):
        self.step = 0
        self.at_steps = set(at_steps)
        self.value = value
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.step in self.at_steps:
            return output + self.value  # stays in the graph, so gradients turn bad too
        return None

    def remove(self) -> None:
        self.handle.remove()
