"""The hookprof Grafana dashboard, as code (grafana-foundation-sdk, Grafana 11 types).

    python grafana/generate.py            # writes grafana/dashboards/hookprof-training.json
    python grafana/generate.py --check    # exits 1 if the committed JSON differs (CI)

Every PromQL expression lives here once; tests/system/test_dashboard_queries.py runs each of them
against a real Prometheus scraping a real `hookprof demo`. Per-layer panels go through
`topk($topk, ...)` and the `layer` variable so that a model with 1,000 layers draws at most
$topk series per panel.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DataTransformerConfig,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "dashboards", "hookprof-training.json")
UID = "hookprof-training"

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# selectors shared by every query: hookprof series carry `rank`; process_* and GPU series
# are per scrape target (one target per rank) and carry job/instance only; the series of an
# attached model (steps, loss, gradients, layers, NaN/Inf, exporter health) also carry
# `model`, one process serving several (a GAN's generator and discriminator). The model
# variable's "All" is ".*", which also matches series without the label (from a hookprof
# that predates it), so the board works with both
TARGET = 'job=~"$job", instance=~"$instance"'
RANKS = TARGET + ', rank=~"$rank"'
MODELS = RANKS + ', model=~"$model"'
LAYERS = MODELS + ', layer=~"$layer"'


def q(
    expr: str,
    legend: str = "__auto",
    ref: str = "A",
    *,
    instant: bool = False,
    table_format: bool = False,
):
    query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    if instant:
        query = query.instant()
    if table_format:
        query = query.format(PromQueryFormat.TABLE)
    return query


def series(
    title: str,
    description: str,
    *queries,
    unit: str = "short",
    log_scale: bool = False,
    width: int = 12,
    height: int = 8,
):
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(10)
        .line_width(1)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM)
        )
    )
    if log_scale:
        panel = panel.scale_distribution(
            common.ScaleDistributionConfig().type(common_models.ScaleDistribution.LOG).log(10)
        )
    for query in queries:
        panel = panel.with_target(query)
    return panel


def single(title: str, description: str, query, unit: str = "short", width: int = 4):
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(4)
        .with_target(query)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def top_layers(title: str, description: str, expr: str, unit: str = "s"):
    return (
        bargauge.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(12)
        .height(10)
        .with_target(q(expr, "{{model}} {{layer}}", instant=True))
        .orientation(common_models.VizOrientation.HORIZONTAL)
        .display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .min(0)
    )


def mean_per_call(metric: str, window: str, selector: str) -> str:
    """Mean seconds per call of a per-layer summary, per model and layer, over `window`."""
    return (
        f"sum by (model, layer) (rate({metric}_sum{{{selector}}}[{window}]))\n"
        f"  / sum by (model, layer) (rate({metric}_count{{{selector}}}[{window}]))"
    )


def variables():
    def labels(name: str, label: str, query: str, multi: bool = True):
        v = (
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query({"query": query, "refId": f"{name}-values", "qryType": 1})
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
        )
        if multi:
            # all_value ".*" keeps the query short when a model has 1,000 layers
            v = v.multi(True).include_all(True).all_value(".*")
        return v

    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        labels("job", "Job", "label_values(hookprof_steps_total, job)"),
        # a name per hookprof.attach(): the class name by default ("Generator", "DeepNet-2")
        labels("model", "Model", 'label_values(hookprof_steps_total{job=~"$job"}, model)'),
        labels(
            "instance",
            "Instance",
            'label_values(hookprof_steps_total{job=~"$job", model=~"$model"}, instance)',
        ),
        labels(
            "rank",
            "Rank",
            'label_values(hookprof_steps_total{job=~"$job", model=~"$model", instance=~"$instance"}, rank)',
        ),
        labels(
            "layer",
            "Layer",
            'label_values(hookprof_layer_forward_seconds_count{job=~"$job", model=~"$model", instance=~"$instance", '
            'rank=~"$rank"}, layer)',
        ),
        dashboard.CustomVariable("topk")
        .label("Top layers")
        .values("10,20,50,100")
        .current(_option("10")),
    ]


def _option(value: str):
    from grafana_foundation_sdk.models.dashboard import VariableOption

    return VariableOption(selected=True, text=value, value=value)


def build() -> dict:
    rate = "$__rate_interval"
    board = (
        dashboard.Dashboard("hookprof: training")
        .uid(UID)
        .description(
            "Per-layer latency, gradients, NaN/Inf incidents and system load of PyTorch "
            "training jobs instrumented with hookprof.attach(model)."
        )
        .tags(["hookprof", "pytorch", "training"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
    )
    for v in variables():
        board = board.with_variable(v)

    board = board.with_row(dashboard.Row("Training"))
    board = board.with_panel(
        series(
            "Steps per second",
            "Optimizer steps (or Profiler.step calls) per second, per model and rank.",
            q(
                f"sum by (model, rank) (rate(hookprof_steps_total{{{MODELS}}}[{rate}]))",
                "{{model}} rank {{rank}}",
            ),
            unit="short",
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Step duration",
            "p50 and p95 of the wall time between step boundaries, per model and rank.",
            q(
                f"histogram_quantile(0.95, sum by (le, model, rank) "
                f"(rate(hookprof_step_duration_seconds_bucket{{{MODELS}}}[{rate}])))",
                "p95 {{model}} rank {{rank}}",
                "A",
            ),
            q(
                f"histogram_quantile(0.5, sum by (le, model, rank) "
                f"(rate(hookprof_step_duration_seconds_bucket{{{MODELS}}}[{rate}])))",
                "p50 {{model}} rank {{rank}}",
                "B",
            ),
            unit="s",
            width=8,
        )
    )
    board = board.with_panel(
        single(
            "Steps",
            "Steps completed per model (a GAN's generator and discriminator count their own), "
            "on the most advanced selected rank.",
            q(f"max by (model) (hookprof_steps_total{{{MODELS}}})", "{{model}}", instant=True),
            width=4,
        )
    )
    board = board.with_panel(
        single(
            "Since last step",
            "Seconds since the most recent step of each model on its slowest selected rank.",
            q(
                f"time() - min by (model) (hookprof_last_step_timestamp_seconds{{{MODELS}}})",
                "{{model}}",
                instant=True,
            ),
            unit="s",
            width=4,
        )
    )
    board = board.with_panel(
        series(
            "Loss",
            "Loss passed to Profiler.step(loss=...), at sampled steps.",
            q(f"hookprof_loss{{{MODELS}}}", "{{model}} rank {{rank}}"),
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Global gradient norm",
            "L2 norm over all parameters' gradients at the last sampled step (log scale).",
            q(f"hookprof_gradient_norm{{{MODELS}}}", "{{model}} rank {{rank}}"),
            log_scale=True,
            width=12,
        )
    )

    board = with_progress_panels(board)

    board = board.with_row(dashboard.Row("Layers"))
    board = board.with_panel(
        top_layers(
            "Top layers by forward time",
            "Mean forward seconds per call over the dashboard range, the $topk slowest layers.",
            f"topk($topk, {mean_per_call('hookprof_layer_forward_seconds', '$__range', LAYERS)})",
        )
    )
    board = board.with_panel(
        top_layers(
            "Top layers by backward time",
            "Mean backward seconds per call over the dashboard range, the $topk slowest layers.",
            f"topk($topk, {mean_per_call('hookprof_layer_backward_seconds', '$__range', LAYERS)})",
        )
    )
    board = board.with_panel(
        series(
            "Forward latency per layer",
            "Mean forward seconds per call; the $topk slowest layers at each instant.",
            q(
                f"topk($topk, {mean_per_call('hookprof_layer_forward_seconds', rate, LAYERS)})",
                "{{model}} {{layer}}",
            ),
            unit="s",
        )
    )
    board = board.with_panel(
        series(
            "Backward latency per layer",
            "Mean backward seconds per call; the $topk slowest layers at each instant.",
            q(
                f"topk($topk, {mean_per_call('hookprof_layer_backward_seconds', rate, LAYERS)})",
                "{{model}} {{layer}}",
            ),
            unit="s",
        )
    )
    board = board.with_panel(
        series(
            "Gradient norm per layer",
            "L2 norm of each layer's own parameters' gradients at the last sampled step; the $topk largest. "
            "Under FSDP each rank exports its shard's norm: combine with sqrt(sum by (model, layer) (x^2)).",
            q(
                f"topk($topk, max by (model, layer) (hookprof_layer_gradient_norm{{{LAYERS}}}))",
                "{{model}} {{layer}}",
            ),
            log_scale=True,
        )
    )
    board = board.with_panel(
        series(
            "Dead activations per layer",
            "Share of exactly-zero outputs of parameter-free layers (ReLU, dropout, pooling); the $topk highest.",
            q(
                f"topk($topk, max by (model, layer) (hookprof_layer_activation_zero_ratio{{{LAYERS}}}))",
                "{{model}} {{layer}}",
            ),
            unit="percentunit",
        )
    )

    board = efficiency_and_stragglers(board, rate)

    board = board.with_row(dashboard.Row("NaN / Inf and gradient health"))
    board = board.with_panel(
        table.Panel()
        .title("First non-finite layer")
        .description(
            "Where each model's first NaN/Inf appeared on each rank: the producing layer, the phase and the step."
        )
        .datasource(DS)
        .span(12)
        .height(8)
        .with_target(
            q(
                "max by (job, instance, rank, model, layer, phase, step) "
                f"(hookprof_first_nonfinite_info{{{MODELS}}})",
                instant=True,
                table_format=True,
            )
        )
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "Value": True},
                    "indexByName": {
                        "model": 0,
                        "rank": 1,
                        "layer": 2,
                        "phase": 3,
                        "step": 4,
                        "instance": 5,
                        "job": 6,
                    },
                },
            )
        )
    )
    board = board.with_panel(
        series(
            "Non-finite steps",
            "Steps whose model output (forward), gradients (backward) or loss held a NaN/Inf.",
            q(
                f"sum by (model, rank, phase) (increase(hookprof_nonfinite_steps_total{{{MODELS}}}[{rate}]))",
                "{{model}} {{phase}} rank {{rank}}",
            ),
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "GradScaler skipped steps",
            "Optimizer steps GradScaler skipped because its gradients overflowed.",
            q(
                f"sum by (model, rank) (increase(hookprof_skipped_steps_total{{{MODELS}}}[{rate}]))",
                "{{model}} rank {{rank}}",
            ),
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Vanishing / exploding gradients",
            "Sampled steps on which some layer's gradient norm fell below vanishing_grad_norm or rose above exploding_grad_norm.",
            q(
                f"sum by (model, rank, kind) (increase(hookprof_gradient_flagged_steps_total{{{MODELS}}}[{rate}]))",
                "{{model}} {{kind}} rank {{rank}}",
            ),
            width=12,
        )
    )

    board = board.with_panel(
        series(
            "Spikes (no NaN)",
            "Loss and global gradient-norm spikes, and jumps of a layer's update-to-weight "
            "ratio, by kind (events: docs/nonfinite.md). No NaN yet; a divergence often starts so.",
            q(
                f"sum by (model, rank, kind) (increase(hookprof_spikes_total{{{MODELS}}}[{rate}]))",
                "{{model}} {{kind}} rank {{rank}}",
            ),
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Silent data corruption checks",
            "With sdc_check_interval_s (docs/integrity.md): check steps whose parameters changed "
            "between the forward and the update on that rank, and replays that did not reproduce "
            "the step or could not be compared. Replicas that disagree page through "
            "HookprofReplicaParametersDiffer / HookprofReplicasDisagree.",
            q(
                "sum by (model, rank) (increase("
                f"hookprof_parameter_changes_outside_update_total{{{MODELS}}}[{rate}]))",
                "{{model}} parameters changed outside the update, rank {{rank}}",
            ),
            q(
                "sum by (model, rank, result) (increase("
                f'hookprof_replay_checks_total{{{MODELS}, result!="reproduced"}}[{rate}]))',
                "{{model}} replay {{result}} rank {{rank}}",
                "B",
            ),
            width=12,
        )
    )

    board = board.with_row(dashboard.Row("System"))
    board = board.with_panel(
        series(
            "CPU",
            "Training process CPU (cores busy) and host CPU utilisation.",
            q(f"rate(process_cpu_seconds_total{{{TARGET}}}[{rate}])", "process {{instance}}", "A"),
            q(f"hookprof_host_cpu_utilization_ratio{{{TARGET}}}", "host {{instance}}", "B"),
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Memory",
            "Training process resident memory, and host memory in use.",
            q(f"process_resident_memory_bytes{{{TARGET}}}", "RSS {{instance}}", "A"),
            q(
                f"hookprof_host_memory_total_bytes{{{TARGET}}} - hookprof_host_memory_available_bytes{{{TARGET}}}",
                "host used {{instance}}",
                "B",
            ),
            unit="bytes",
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Open files",
            "File descriptors held by the training process.",
            q(f"process_open_fds{{{TARGET}}}", "{{instance}}"),
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "GPU utilisation",
            "NVML utilisation per GPU (exported by local rank 0 of each node).",
            q(f"hookprof_gpu_utilization_ratio{{{TARGET}}}", "{{instance}} gpu {{gpu}}"),
            unit="percentunit",
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "GPU memory",
            "Device memory in use (NVML, all processes) and PyTorch's own allocated and reserved memory.",
            q(f"hookprof_gpu_memory_used_bytes{{{TARGET}}}", "used {{instance}} gpu {{gpu}}", "A"),
            q(
                f"hookprof_gpu_memory_total_bytes{{{TARGET}}}",
                "total {{instance}} gpu {{gpu}}",
                "B",
            ),
            q(
                f"hookprof_cuda_memory_allocated_bytes{{{RANKS}}}",
                "torch allocated rank {{rank}} cuda:{{device}}",
                "C",
            ),
            q(
                f"hookprof_cuda_memory_reserved_bytes{{{RANKS}}}",
                "torch reserved rank {{rank}} cuda:{{device}}",
                "D",
            ),
            unit="bytes",
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "GPU power and temperature",
            "Power draw (W) and core temperature (°C) per GPU.",
            q(f"hookprof_gpu_power_watts{{{TARGET}}}", "W {{instance}} gpu {{gpu}}", "A"),
            q(f"hookprof_gpu_temperature_celsius{{{TARGET}}}", "°C {{instance}} gpu {{gpu}}", "B"),
            width=8,
        )
    )

    board = board.with_row(dashboard.Row("Exporter health"))
    board = board.with_panel(
        series(
            "Scrape targets up",
            "1 while Prometheus can scrape the rank's /metrics endpoint, and while hookprof's publisher thread is alive.",
            q(f"up{{{TARGET}}}", "scrape {{instance}}", "A"),
            q(
                f"hookprof_publisher_thread_up{{{MODELS}}}",
                "publisher {{model}} rank {{rank}}",
                "B",
            ),
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "hookprof internal errors",
            "Errors inside hookprof's own hooks (training continues; per-layer hooks switch off).",
            q(
                f"sum by (model, rank) (increase(hookprof_internal_errors_total{{{MODELS}}}[{rate}]))",
                "{{model}} rank {{rank}}",
            ),
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Layers exported",
            "Instrumented layers and the layers exported under the max_layers budget.",
            q(f"hookprof_layers{{{MODELS}}}", "instrumented {{model}} rank {{rank}}", "A"),
            q(f"hookprof_layers_exported{{{MODELS}}}", "exported {{model}} rank {{rank}}", "B"),
            width=8,
        )
    )
    board = board.with_panel(
        series(
            "Rejected connections to /metrics",
            "Connections the metrics endpoint refused or closed before answering, by reason: timeouts "
            "(a client that never finishes its TLS handshake or request), failed TLS handshakes (no or an "
            "untrusted client certificate), bad requests, and the http_max_requests / http_max_connections "
            "limits. A rise here with missed scrapes is a broken or hostile client, not a slow trainer.",
            q(
                f"sum by (instance, reason) (increase(hookprof_http_connections_rejected_total{{{TARGET}}}[{rate}]))",
                "{{reason}} {{instance}}",
            ),
            width=24,
        )
    )
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def with_progress_panels(board):
    """Issue 19 / 15: where each step's time goes, where each rank is, and current stalls."""
    rate = "$__rate_interval"
    board = board.with_row(dashboard.Row("Step phases and stalls"))
    phases = series(
        "Step time by phase",
        "Mean host seconds per step in each phase (data wait, forward, backward, optimizer, other), "
        "stacked: the stack is the mean step time. Every step, per model and rank.",
        q(
            f"sum by (model, rank, phase) (rate(hookprof_step_phase_seconds_sum{{{MODELS}}}[{rate}]))\n"
            f"  / sum by (model, rank, phase) (rate(hookprof_step_phase_seconds_count{{{MODELS}}}[{rate}]))",
            "{{model}} rank {{rank}} {{phase}}",
        ),
        unit="s",
        width=8,
    )
    board = board.with_panel(
        phases.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
    )
    device_phases = series(
        "Device time by phase (CUDA)",
        "Mean device seconds per sampled step in each phase: the CUDA stream's progress between the "
        "host's phase boundaries, stacked. A phase's own kernels when the GPU is the bottleneck; when "
        "the host is, the host's pace, and data shows the GPU idle while the batch loads. Only with "
        "a model on CUDA (docs/stalls.md); no data on a CPU.",
        q(
            per_rank_mean("hookprof_step_phase_device_seconds", rate, by="model, rank, phase"),
            "{{model}} rank {{rank}} {{phase}}",
        ),
        unit="s",
        width=8,
    )
    board = board.with_panel(
        device_phases.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL))
    )
    board = board.with_panel(
        series(
            "Progress per rank",
            "The step each rank is in. A rank that stops while the others wait in a collective falls "
            "behind here first (HookprofRankStuck names it).",
            q(f"hookprof_progress_step{{{MODELS}}}", "{{model}} rank {{rank}}"),
            width=8,
        )
    )
    board = board.with_panel(
        table.Panel()
        .title("Current stalls")
        .description(
            "Each rank's stall state: 1 while its current phase outlasts its learned threshold, "
            "with the step, phase, innermost layer and what it waits on (collective, data, device, code)."
        )
        .datasource(DS)
        .span(8)
        .height(8)
        .with_target(
            q(
                f"max by (rank, model, step, phase, layer, waiting_on) (hookprof_stall_info{{{MODELS}}})\n"
                f"  or max by (rank, model) (hookprof_stalled{{{MODELS}}})",
                instant=True,
                table_format=True,
            )
        )
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {
                        "model": 0,
                        "rank": 1,
                        "Value": 2,
                        "step": 3,
                        "phase": 4,
                        "layer": 5,
                        "waiting_on": 6,
                    },
                    "renameByName": {"Value": "stalled"},
                },
            )
        )
    )
    return board


def per_rank_mean(metric: str, window: str, by: str = "model, rank") -> str:
    """Mean seconds per observation of a summary or histogram, per `by`, over `window`."""
    return (
        f"sum by ({by}) (rate({metric}_sum{{{MODELS}}}[{window}]))\n"
        f"  / sum by ({by}) (rate({metric}_count{{{MODELS}}}[{window}]))"
    )


def rank_series(title: str, description: str, metric: str, **options):
    """One per-model gauge, a line per model and rank."""
    return series(
        title, description, q(f"{metric}{{{MODELS}}}", "{{model}} rank {{rank}}"), **options
    )


def efficiency_and_stragglers(board, rate: str):
    """Issue 15: FLOPs, MFU, update ratios; each rank against the median of ranks, by step
    time and by step phase (the phases show the straggler of ranks that synchronise)."""
    board = board.with_row(dashboard.Row("Efficiency"))
    board = board.with_panel(
        rank_series(
            "Model FLOP/s",
            "Achieved FLOP/s of each model per rank: FLOPs of a training step (counted per layer with "
            "torch.utils.flop_counter) over the mean wall time of recent steps.",
            "hookprof_model_flops_per_second",
            unit="flops",
            width=12,
        )
    )
    board = board.with_panel(
        rank_series(
            "Model FLOPs utilisation (MFU)",
            "Achieved FLOP/s over the device's peak for the model's precision (Config.peak_flops, or the "
            "GPU's datasheet figure). No data where the peak is unknown (CPUs, unlisted GPUs).",
            "hookprof_model_flops_utilization_ratio",
            unit="percentunit",
            width=12,
        )
    )
    layer_time = (
        f"sum by (model, layer) (rate(hookprof_layer_forward_seconds_sum{{{LAYERS}}}[$__range]))\n"
        f"  + sum by (model, layer) (rate(hookprof_layer_backward_seconds_sum{{{LAYERS}}}[$__range]))"
    )
    board = board.with_panel(
        top_layers(
            "Achieved FLOP/s of the slowest layers",
            "The $topk layers with the most forward and backward time over the dashboard range, and the "
            "FLOP/s each achieved at the last sampled step: a slow layer with a low rate runs "
            "inefficiently, a slow layer with a high rate is simply big.",
            f"topk($topk, max by (model, layer) (hookprof_layer_flops_per_second{{{LAYERS}}})\n"
            f"  and on (model, layer) topk($topk, {layer_time}))",
            unit="flops",
        )
    )
    board = board.with_panel(
        rank_series(
            "Update-to-weight ratio",
            "How far one optimizer step moves the weights: the global norm of the update over the global "
            "norm of the weights, on sampled steps (log scale). Spikes here come before loss spikes.",
            "hookprof_update_ratio",
            log_scale=True,
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Update-to-weight ratio per layer",
            "Each layer's update norm over its weight norm at its last measurement; the $topk largest "
            "(layers take turns when the model exceeds Config.update_norm_max_bytes).",
            q(
                f"topk($topk, max by (model, layer) (hookprof_layer_update_ratio{{{LAYERS}}}))",
                "{{model}} {{layer}}",
            ),
            log_scale=True,
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Weight norm per layer",
            "L2 norm of each layer's own parameters after the update, at the last sampled step; the $topk largest.",
            q(
                f"topk($topk, max by (model, layer) (hookprof_layer_weight_norm{{{LAYERS}}}))",
                "{{model}} {{layer}}",
            ),
            log_scale=True,
            width=12,
        )
    )

    board = board.with_row(dashboard.Row("Stragglers"))
    step_time = per_rank_mean("hookprof_step_duration_seconds", rate)
    board = board.with_panel(
        series(
            "Step time per rank and the median of ranks",
            "Mean step time of each rank, and the median over the selected ranks. Ranks that synchronise "
            "every step (DDP, FSDP) finish steps together: their waiting shows in the step phases below.",
            q(step_time, "{{model}} rank {{rank}}", "A"),
            q(f"quantile by (model) (0.5, {step_time})", "{{model}} median of ranks", "B"),
            unit="s",
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Slowest rank over the median",
            "The slowest rank's mean step time over the median of ranks (1 = no straggler); "
            "HookprofStragglerRank fires above 1.5 for 10 minutes.",
            q(
                f"max by (model) ({step_time})\n  / quantile by (model) (0.5, {step_time})",
                "{{model}}",
            ),
            width=12,
        )
    )
    phase_time = per_rank_mean("hookprof_step_phase_seconds", rate, by="model, rank, phase")
    board = board.with_panel(
        series(
            "Step phases per rank over the median of ranks",
            "Each rank's mean time per step in each phase (data, forward, backward, optimizer, other) over "
            "the median of ranks for that phase: a straggler's own phase stands above 1, the others wait "
            "where their next collective is (backward under DDP, forward under FSDP).",
            q(
                f"{phase_time}\n  / on (model, phase) group_left quantile by (model, phase) (0.5, {phase_time})",
                "{{model}} {{phase}} rank {{rank}}",
            ),
            width=12,
        )
    )
    board = board.with_panel(
        series(
            "Step phases per rank above the median of ranks",
            "Seconds per step each rank spends in each phase beyond the median of ranks for that phase (a "
            "ratio of tiny phases can be large; this cannot). Under DDP the straggler stands out in its own "
            "phase (data, forward, optimizer or other) and the ranks waiting for it in backward, under FSDP "
            "in forward; HookprofStragglerPhase names the straggler and its phase (docs/efficiency.md).",
            q(
                f"{phase_time}\n  - on (model, phase) group_left quantile by (model, phase) (0.5, {phase_time})",
                "{{model}} {{phase}} rank {{rank}}",
            ),
            unit="s",
            width=12,
        )
    )
    return layer_stragglers(board)


LAYER_RATIO = "hookprof:layer_seconds_per_call:ratio_to_median_of_ranks"


def layer_stragglers(board):
    """Issue 42: which rank is slow in which layer and phase. Needs the recording rules of
    deploy/prometheus/hookprof-rules.yml (hookprof.layer_stragglers), as the alert does."""
    # layers of at least 0.1 ms per call (the alert's floor): the ratio of a 20 us layer is
    # mostly noise, and would sort itself first
    ratio = (
        f'{LAYER_RATIO}{{{MODELS}, layer=~"$layer"}}\n  and on (job, model, layer, phase) '
        'hookprof:layer_seconds_per_call:median_of_ranks{job=~"$job", model=~"$model"} > 0.0001'
    )
    board = board.with_panel(
        table.Panel()
        .title("Layer time per rank over the median of ranks")
        .description(
            "Each rank's time per call in each layer's forward and backward over the median of "
            "the job's ranks (each rank's median over its last five sampled steps, so that one "
            "preempted call does not count; layers of 0.1 ms per call or more): a row per layer and "
            "phase, a column per rank, the rows with the worst cell first. 1 is the median; "
            "HookprofStragglerLayer fires at 1.3 (and 0.1 ms per call above it) for 30 s. Under "
            "DDP the ranks waiting for a bucket's all-reduce inside a layer's backward are the median, "
            "the straggler's own layer stands out."
        )
        .datasource(DS)
        .span(12)
        .height(10)
        .unit("none")
        .decimals(2)
        .with_target(
            q(
                f'sort_desc(label_join(\n  {ratio},\n  "cell", " ", "model", "layer", "phase"))',
                instant=True,
                table_format=True,
            )
        )
        .with_transformation(
            DataTransformerConfig(
                id_val="groupingToMatrix",
                options={
                    "columnField": "rank",
                    "rowField": "cell",
                    "valueField": "Value",
                    "emptyValue": "null",
                },
            )
        )
        .cell_options(
            common_models.TableColoredBackgroundCellOptions(
                mode=common_models.TableCellBackgroundDisplayMode.BASIC
            )
        )
        .thresholds(
            dashboard.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps(
                [
                    Threshold(color="green", value=None),
                    Threshold(color="yellow", value=1.15),
                    Threshold(color="red", value=1.3),
                ]
            )
        )
    )
    return board.with_panel(
        bargauge.Panel()
        .title("Slowest rank, layer and phase")
        .description(
            "The highest ratios ($topk) of a rank's time per call in a layer and phase to the median "
            "of ranks (the worst cells of the table beside it)."
        )
        .datasource(DS)
        .span(12)
        .height(10)
        .with_target(
            q(f"topk($topk, {ratio})", "{{model}} rank {{rank}} {{layer}} {{phase}}", instant=True)
        )
        .orientation(common_models.VizOrientation.HORIZONTAL)
        .display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .min(1)
    )


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expressions(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel of a dashboard JSON."""
    out = []
    for panel in board.get("panels", []):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel["title"], target["expr"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = open(OUTPUT, encoding="utf-8").read() if os.path.exists(OUTPUT) else ""
        if current != text:
            sys.stdout.writelines(
                difflib.unified_diff(
                    current.splitlines(True), text.splitlines(True), OUTPUT, "generated"
                )
            )
            print(
                f"\n{OUTPUT} is stale: run python grafana/generate.py and commit it",
                file=sys.stderr,
            )
            return 1
        print(f"{OUTPUT} is up to date")
        return 0
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    with open(OUTPUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
