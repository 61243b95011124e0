"""Issue 29 item 9: the cardinality budget counts series, not layers, and the docs' per-layer
figures are what a real scrape holds (docs/metrics.md, Cardinality; docs/scale.md)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hookprof
from support.metrics import parse, scrape

# docs/metrics.md, Cardinality: series per exported layer with the defaults, once five
# sampled steps have given each timing its recent median (quantile="0.5", publish/recent.py)
DOCS_SERIES = {"Linear": 14, "LayerNorm": 13, "ReLU": 10}
# a layer on the page with its time alone: forward and backward _sum, _count and median
TIMED = 6


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


def train_and_scrape(model: nn.Module | None = None, **config) -> tuple[dict, dict, float, Any]:
    """Five sampled steps of `model` (Wide() by default) with `config`; returns the page's
    per-layer series, the layers' module types, hookprof_layers_exported and the snapshot."""
    torch.manual_seed(0)
    model = model if model is not None else Wide()
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
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
        prof.flush()
        text = scrape(prof.url, timeout=60)
        snap = prof.snapshot()
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if name}
    exported = next(
        s.value
        for f in parse(text).values()
        for s in f.samples
        if s.name == "hookprof_layers_exported"
    )
    return per_layer_series(text), kinds, exported, snap


def test_the_docs_per_layer_figures_are_what_a_scrape_holds():
    series, kinds, exported, _ = train_and_scrape()
    assert exported == 300 and len(series) == 300
    for layer, count in series.items():
        assert count == DOCS_SERIES[kinds[layer]], (layer, kinds[layer])
    assert sum(series.values()) == 100 * (14 + 13 + 10)  # 3,700: within the default budget


def test_the_budget_counts_series_not_layers():
    """max_layer_series=1000 on 300 layers (3,700 series unbounded): at most 1,000 per-layer
    series, the layers with the most time, whole (a layer's series all or none)."""
    series, kinds, exported, _ = train_and_scrape(max_layer_series=1000)
    assert sum(series.values()) <= 1000
    assert sum(series.values()) > 1000 - 14  # filled up to the last layer that fits
    assert exported == len(series)
    for layer, count in series.items():
        assert count == DOCS_SERIES[kinds[layer]], layer


def test_detailed_layers_keeps_time_for_every_layer_and_the_rest_for_the_slowest():
    """Issue 42 item 3, at scale: detailed_layers=10 on 300 layers. Every layer keeps its
    forward and backward time (6 series: what the straggler rule reads), and exactly the 10
    layers with the most forward+backward time, by the snapshot's own totals, keep all of
    their figures."""
    series, kinds, exported, _ = train_and_scrape(detailed_layers=10)
    assert exported == 300 and len(series) == 300
    detailed = {layer for layer, count in series.items() if count > TIMED}
    assert len(detailed) == 10
    for layer, count in series.items():
        assert count == (DOCS_SERIES[kinds[layer]] if layer in detailed else TIMED), layer
    assert sum(series.values()) == TIMED * 290 + sum(DOCS_SERIES[kinds[x]] for x in detailed)


class OneBranchNonfinite(Wide):
    """Wide, with branch 17's output non-finite and kept out of the loss (detached, then
    zeroed): three layers go non-finite in the forward, every gradient stays finite."""

    def forward(self, x):
        return sum(
            torch.nan_to_num(block(x).detach(), nan=0.0) if i == 17 else block(x)
            for i, block in enumerate(self.blocks)
        )


def test_detailed_layers_are_the_slowest_and_every_nonfinite_one():
    torch.manual_seed(0)
    model = OneBranchNonfinite(blocks=30)
    model.blocks[17][0].bias.data[0] = float("nan")  # this Linear's output goes NaN
    series, _, _, snap = train_and_scrape(model, detailed_layers=3)
    bad = {name for name, s in snap.layers.items() if any(s.nonfinite.values())}
    assert bad == {"blocks.17.0", "blocks.17.1", "blocks.17.2"}
    by_time = sorted(
        (n for n in snap.layers if n not in bad),
        key=lambda n: snap.layers[n].forward_seconds_total + snap.layers[n].backward_seconds_total,
        reverse=True,
    )
    assert set(snap.exported_layers) == bad | set(by_time[:3])
    assert set(snap.timed_layers) == set(by_time[3:])
    for layer in snap.timed_layers:
        assert series[layer] == TIMED, layer
    for layer in snap.exported_layers:  # the non-finite counters are theirs
        assert series[layer] > TIMED, layer


def test_detailed_layers_within_a_series_budget():
    """detailed_layers=10 and max_layer_series=600: the 10 slowest whole, then the next
    slowest with their time alone (6 series) until the budget is full."""
    series, kinds, exported, _ = train_and_scrape(detailed_layers=10, max_layer_series=600)
    detailed = {layer for layer, count in series.items() if count > TIMED}
    assert len(detailed) == 10
    full = sum(DOCS_SERIES[kinds[x]] for x in detailed)
    assert exported == len(series) == 10 + (600 - full) // TIMED
    assert sum(series.values()) <= 600


def test_detailed_layers_time_every_layer_beyond_max_layers():
    """max_layers bounds the detailed layers only: with detailed_layers set, every layer keeps
    its time series (what the straggler rule compares) while the series budget allows."""
    series, _, exported, snap = train_and_scrape(detailed_layers=5, max_layers=100)
    assert exported == 300 and len(series) == 300
    assert len(snap.exported_layers) == 5 and len(snap.timed_layers) == 295


def test_flagged_layers_keep_the_series_their_alert_points_to():
    """HookprofLayerGradientsExploding says hookprof_layer_gradient_flagged_steps_total names
    the layers: a layer whose gradients were flagged is detailed, like a non-finite one."""
    series, _, _, snap = train_and_scrape(
        Wide(blocks=10), detailed_layers=1, vanishing_grad_norm=0.0, exploding_grad_norm=1e-9
    )
    flagged = {n for n, s in snap.layers.items() if any(s.gradient_flags.values())}
    assert len(flagged) >= 20  # every Linear and LayerNorm
    assert flagged <= set(snap.exported_layers)
    for layer in flagged:
        assert series[layer] > TIMED, layer
