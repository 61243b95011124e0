"""The efficiency figures of a Snapshot as Prometheus metric families (names in
docs/efficiency.md): FLOPs and achieved FLOP/s per layer and for the model, utilisation of
the device's peak, weight and update norms. Rendered by exporter.SnapshotCollector."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from hookprof.snapshot import Snapshot

# (attribute of LayerEfficiency, metric name, help)
_LAYER_GAUGES = (
    ("forward_flops", "hookprof_layer_forward_flops",
     "FLOPs per forward call of the layer (torch.utils.flop_counter, counted once per input shape)"),
    ("backward_flops", "hookprof_layer_backward_flops",
     "FLOPs of the backward of one call of the layer"),
    ("flops_per_second", "hookprof_layer_flops_per_second",
     "Achieved FLOP/s of the layer at the last sampled step: its FLOPs over its measured "
     "forward and backward time"),
    ("weight_norm", "hookprof_layer_weight_norm",
     "L2 norm of the layer's own parameters after the last sampled step's update"),
    ("update_norm", "hookprof_layer_update_norm",
     "L2 norm of the change the optimizer made to the layer's parameters, at the last "
     "sampled step that measured it"),
    ("update_ratio", "hookprof_layer_update_ratio",
     "Update norm over weight norm of the layer, at the last sampled step that measured it"),
)


def efficiency_families(snap: Snapshot, rank: str) -> Iterator[Metric]:
    eff = snap.efficiency
    if eff is None:
        return
    for attr, name, text in _LAYER_GAUGES:
        family = GaugeMetricFamily(name, text, labels=["rank", "layer"])
        for layer in snap.exported_layers:
            stats = eff.layers.get(layer)
            value = getattr(stats, attr) if stats is not None else None
            if value is not None:
                family.add_metric([rank, layer], value)
        yield family
    for value, name, text in (
        (eff.flops_per_second, "hookprof_model_flops_per_second",
         "Achieved FLOP/s of the model: FLOPs of a training step over the mean wall time of the "
         "steps since the sampled step before"),
        (eff.flops_utilization, "hookprof_model_flops_utilization_ratio",
         "Model FLOPs utilisation: achieved FLOP/s over the device's peak (Config.peak_flops, or "
         "the known GPU's); absent when the peak is unknown"),
        (eff.update_ratio, "hookprof_update_ratio",
         "Global update-to-weight ratio: sqrt of summed squared update norms over summed squared "
         "weight norms, over every layer's latest measurement"),
    ):
        if value is not None:
            family = GaugeMetricFamily(name, text, labels=["rank"])
            family.add_metric([rank], value)
            yield family
