"""The efficiency figures of a Snapshot as Prometheus metric families (docs/efficiency.md;
names in hookprof/metrics_names.py): FLOPs and achieved FLOP/s per layer and for the model,
utilisation of the device's peak, the model's update ratio. Rendered by
serve/exporter.SnapshotCollector."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from hookprof import metrics_names as names
from hookprof.metrics_names import family
from hookprof.snapshot import Snapshot

# (attribute of LayerEfficiency, its metric)
_LAYER_GAUGES = (
    ("forward_flops", names.LAYER_FORWARD_FLOPS),
    ("backward_flops", names.LAYER_BACKWARD_FLOPS),
    ("flops_per_second", names.LAYER_FLOPS_PER_SECOND),
)  # (the weight and update norms and ratio: statistics, with the others: serve/exporter.py)


def efficiency_families(snap: Snapshot, rank: str) -> Iterator[Metric]:
    eff = snap.efficiency
    if eff is None:
        return
    for attr, metric in _LAYER_GAUGES:
        gauge = family(metric)
        for layer in snap.exported_layers:
            stats = eff.layers.get(layer)
            value = getattr(stats, attr) if stats is not None else None
            if value is not None:
                gauge.add_metric([rank, layer], value)
        yield gauge
    for value, metric in (
        (eff.flops_per_second, names.MODEL_FLOPS_PER_SECOND),
        (eff.flops_utilization, names.MODEL_FLOPS_UTILIZATION_RATIO),
        (eff.update_ratio, names.UPDATE_RATIO),
    ):
        if value is not None:
            gauge = family(metric)
            gauge.add_metric([rank], value)
            yield gauge
