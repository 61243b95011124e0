"""Issue 29 item 9: the cardinality budget counts series, not layers, and the docs' per-layer
figures are what a real scrape holds (docs/metrics.md, Cardinality; docs/scale.md)."""

from __future__ import annotations

import torch
from torch import nn

import hookprof
from support.metrics import parse, scrape

# docs/metrics.md, Cardinality: series per exported layer with the defaults
DOCS_SERIES = {"Linear": 12, "LayerNorm": 11, "ReLU": 8}


class Wide(nn.Module):
    """100 branches of Linear -> LayerNorm -> ReLU side by side, summed: 300 leaves, small,
    and shallow (a deep stack would flag vanishing gradients: a conditional series more)."""

    def __init__(self, blocks: int = 100, dim: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.ReLU()) for _ in range(blocks)
        )

    def forward(self, x):
        return sum(block(x) for block in self.blocks)


def per_layer_series(text: str) -> dict[str, int]:
    """layer -> its series on the page (every sample that carries a `layer` label)."""
    out: dict[str, int] = {}
    for family in parse(text).values():
        for s in family.samples:
            if "layer" in s.labels and s.name.startswith("hookprof_layer"):
                out[s.labels["layer"]] = out.get(s.labels["layer"], 0) + 1
    return out


def train_and_scrape(**config) -> tuple[dict[str, int], dict[str, str], float]:
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(
        model,
        port=0,
        sample_every=1,
        min_sample_interval_s=0.0,
        activation_interval_s=0.0,
        peak_flops=1e12,
        **config,
    ) as prof:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
        prof.flush()
        text = scrape(prof.url, timeout=60)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if name}
    exported = next(
        s.value
        for f in parse(text).values()
        for s in f.samples
        if s.name == "hookprof_layers_exported"
    )
    return per_layer_series(text), kinds, exported


def test_the_docs_per_layer_figures_are_what_a_scrape_holds():
    series, kinds, exported = train_and_scrape()
    assert exported == 300 and len(series) == 300
    for layer, count in series.items():
        assert count == DOCS_SERIES[kinds[layer]], (layer, kinds[layer])
    assert sum(series.values()) == 100 * (12 + 11 + 8)  # 3,100: within the default budget


def test_the_budget_counts_series_not_layers():
    """max_layer_series=1000 on 300 layers (3,100 series unbounded): at most 1,000 per-layer
    series, the layers with the most time, whole (a layer's series all or none)."""
    series, kinds, exported = train_and_scrape(max_layer_series=1000)
    assert sum(series.values()) <= 1000
    assert sum(series.values()) > 1000 - 12  # filled up to the last layer that fits
    assert exported == len(series)
    for layer, count in series.items():
        assert count == DOCS_SERIES[kinds[layer]], layer
