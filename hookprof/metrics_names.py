"""Every series hookprof exports: its name, type, labels and help text, defined once.

The names are a contract with the dashboards (grafana/), the alert rules (deploy/), the
tests and docs/metrics.md: a name or label is added here, never renamed. Who uses it:

- the writers build their families with `family()` (serve/exporter.py, serve/system.py,
  serve/endpoint.py, serve/server.py, efficiency/families.py, phases/families.py);
- the readers find samples by these names (view/table.py reading a scraped page);
- tests/behaviour/test_metrics_docs.py checks docs/metrics.md against this module and
  against what `hookprof demo` exports; tests/unit/test_metrics_names.py checks the names
  against the Prometheus naming rules.

A foundation: it imports nothing of hookprof's (prometheus_client only, for `family`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)

Kind = Literal["counter", "gauge", "summary", "histogram"]

PREFIX = "hookprof_"
MODEL_LABEL = "model"  # added by the endpoint to every per-model series (several models share it)


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    """As a query names it: a counter's ends in _total; a summary's or histogram's is the
    base of its _sum/_count/_bucket samples."""

    kind: Kind

    labels: tuple[str, ...]
    """As the writer sets them; a per-model series also gets `model` on the endpoint."""

    help: str

    per_model: bool = True
    """False for the series a process's endpoint serves once, whatever its models."""

    @property
    def family_name(self) -> str:
        """The name prometheus_client gives the family (its parser too): no _total."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def exported_labels(self) -> tuple[str, ...]:
        """The labels on the endpoint's page (hookprof.attach serving)."""
        return (MODEL_LABEL, *self.labels) if self.per_model else self.labels

    def sample(self, part: str) -> str:
        """The name of one sample of a summary or histogram: "sum", "count" or "bucket"."""
        return f"{self.name}_{part}"


_FAMILIES = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "summary": SummaryMetricFamily,
    "histogram": HistogramMetricFamily,
}


def family(metric: Metric, value: float | None = None) -> Any:
    """A prometheus_client family of `metric`'s kind, name, help and labels, to add samples
    to; with `value`, the one sample of a metric without labels. (Typed Any: the four family
    classes' add_metric take different arguments, buckets for a histogram.)"""
    cls = _FAMILIES[metric.kind]
    if value is not None:
        return cls(metric.name, metric.help, value=value)
    return cls(metric.name, metric.help, labels=metric.labels)


_RANK = ("rank",)
_LAYER = ("rank", "layer")

# ---- steps (serve/exporter.py) ----

STEPS_TOTAL = Metric("hookprof_steps_total", "counter", _RANK, "Training steps completed")
SAMPLED_STEPS_TOTAL = Metric(
    "hookprof_sampled_steps_total", "counter", _RANK, "Steps with per-layer hooks installed"
)
SAMPLED_STEP_SECONDS_TOTAL = Metric(
    "hookprof_sampled_step_seconds_total",
    "counter",
    _RANK,
    "Wall time of the sampled steps: the steps the per-layer times are measured over",
)
STEP_DURATION_SECONDS = Metric(
    "hookprof_step_duration_seconds",
    "histogram",
    _RANK,
    "Wall time between step boundaries (optimizer steps or Profiler.step calls)",
)
LAST_STEP_TIMESTAMP_SECONDS = Metric(
    "hookprof_last_step_timestamp_seconds", "gauge", _RANK, "Unix time at which the last step ended"
)
LOSS = Metric("hookprof_loss", "gauge", _RANK, "Loss at the last sampled step")
GRADIENT_NORM = Metric(
    "hookprof_gradient_norm",
    "gauge",
    _RANK,
    "Global L2 norm of all gradients at the last sampled step",
)
NONFINITE_STEPS_TOTAL = Metric(
    "hookprof_nonfinite_steps_total",
    "counter",
    ("rank", "phase"),
    "Steps on which a NaN or Inf was seen, by phase (forward outputs, gradients, loss)",
)
DROPPED_NONFINITE_STEPS_TOTAL = Metric(
    "hookprof_dropped_nonfinite_steps_total",
    "counter",
    _RANK,
    "Steps whose backward made a NaN or Inf that the loop dropped before any optimizer update "
    "(a loss scaler's overflow, a guard that zeroes the gradients): no incident, no alert",
)
FIRST_DROPPED_NONFINITE_INFO = Metric(
    "hookprof_first_dropped_nonfinite_info",
    "gauge",
    ("rank", "layer", "step"),
    "The first step whose non-finite gradients the loop dropped, and its first non-finite layer",
)
SKIPPED_STEPS_TOTAL = Metric(
    "hookprof_skipped_steps_total",
    "counter",
    _RANK,
    "Steps whose optimizer update the GradScaler skipped",
)
HELD_BACK_UPDATES_TOTAL = Metric(
    "hookprof_held_back_updates_total",
    "counter",
    _RANK,
    'Optimizer updates of non-finite steps that hookprof held back (on_nonfinite="skip" or "raise")',
)
GRADIENT_FLAGGED_STEPS_TOTAL = Metric(
    "hookprof_gradient_flagged_steps_total",
    "counter",
    ("rank", "kind"),
    "Sampled steps on which some layer's gradient norm was vanishing (below "
    "Config.vanishing_grad_norm) or exploding (above Config.exploding_grad_norm)",
)
SPIKES_TOTAL = Metric(
    "hookprof_spikes_total",
    "counter",
    ("rank", "kind"),
    "Loss and global gradient-norm spikes in the every-step series (kind loss_spike or "
    "grad_norm_spike), and jumps of a layer's update-to-weight ratio on the steps that measure "
    "it (update_ratio_jump): a robust z-score against the recent values above "
    "Config.loss_spike_z, Config.grad_norm_spike_z or Config.update_ratio_jump_z; one per "
    "event, however many steps it lasts",
)
SPIKE_LAST_STEP = Metric(
    "hookprof_spike_last_step",
    "gauge",
    ("rank", "kind"),
    "First step of the latest spike event of each kind; only kinds that had one",
)
PARAMETER_FINGERPRINT = Metric(
    "hookprof_parameter_fingerprint",
    "gauge",
    ("rank", "replica_group"),
    "52 bits of a bitwise fingerprint of the parameters after the update of the step in "
    "hookprof_parameter_fingerprint_step (Config.sdc_check_interval_s): data-parallel replicas "
    "of the same replica_group (a run, its parameters' names, shapes and dtypes, and "
    "Config.sdc_replica_group) hold the same value at the same step",
)
PARAMETER_FINGERPRINT_STEP = Metric(
    "hookprof_parameter_fingerprint_step",
    "gauge",
    ("rank", "replica_group"),
    "Step after whose update hookprof_parameter_fingerprint was taken",
)
PARAMETER_CHANGES_OUTSIDE_UPDATE_TOTAL = Metric(
    "hookprof_parameter_changes_outside_update_total",
    "counter",
    ("rank",),
    "Check steps (Config.sdc_check_interval_s) on which this rank's parameters changed between "
    "the step's first forward and its update, when only the forward and backward ran: a write "
    "outside the optimizer, by this rank's memory or device (silent data corruption) or by the "
    "loop's own code",
)
PARAMETER_CHANGE_INFO = Metric(
    "hookprof_parameter_change_info",
    "gauge",
    ("rank", "parameter", "step", "changed"),
    "The last check step counted by hookprof_parameter_changes_outside_update_total: the first "
    "parameter, in the model's order, whose bits changed, and how many parameters changed",
)
PARAMETER_CHANGE_TIMESTAMP_SECONDS = Metric(
    "hookprof_parameter_change_timestamp_seconds",
    "gauge",
    ("rank",),
    "Unix time at which the change in hookprof_parameter_change_info was judged (the alert "
    "fires for 30 minutes from it, whatever the scrapes missed)",
)
PARAMETER_WATCHES_TOTAL = Metric(
    "hookprof_parameter_watches_total",
    "counter",
    ("rank", "result"),
    "Check steps whose parameters were watched from the first forward to the update, by "
    "result: compared, or not_compared (no optimizer hook, a forward inside a closure, a "
    "compiled model's forward, a parameter replaced meanwhile)",
)
REPLAY_CHECKS_TOTAL = Metric(
    "hookprof_replay_checks_total",
    "counter",
    ("rank", "result"),
    "Check steps whose forward was replayed before the update and its layers' outputs compared "
    "bitwise with the step's own (Config.sdc_check_interval_s), by result: reproduced, "
    "not_reproduced (a layer's output differed), not_compared (the step could not be replayed "
    "as it ran)",
)
SPIKE_REPLAYS_TOTAL = Metric(
    "hookprof_spike_replays_total",
    "counter",
    ("rank", "result"),
    "Steps whose loss or gradient norm passed the spike gate, replayed from their inputs, RNG "
    "and weights after the update and their output compared bitwise with the step's own "
    "(Config.spike_replay), by result: reproduced (the data), not_reproduced (the machine), "
    "not_compared (the step could not be replayed as it ran)",
)
REPLAY_MISMATCH_INFO = Metric(
    "hookprof_replay_mismatch_info",
    "gauge",
    ("rank", "layer", "step", "deterministic"),
    "The last check step whose replay did not reproduce its forward: the first layer whose "
    "output differed, and whether torch's deterministic algorithms were on (always 1)",
)
REPLAY_MISMATCH_TIMESTAMP_SECONDS = Metric(
    "hookprof_replay_mismatch_timestamp_seconds",
    "gauge",
    ("rank",),
    "Unix time at which the mismatch in hookprof_replay_mismatch_info was judged (the alert "
    "fires for 30 minutes from it, whatever the scrapes missed)",
)
SPIKE_MISMATCH_INFO = Metric(
    "hookprof_spike_mismatch_info",
    "gauge",
    ("rank", "layer", "step", "deterministic", "phase"),
    "The last spike whose replay (Config.spike_replay) did not reproduce its step: the first "
    "layer or block whose output differed ((root): only the model's output; (output): its "
    "layers were not compared), phase forward; or, the forward alike, phase backward: the "
    "first layer whose output's gradient differed, in the order the backward computed them "
    "(the wrong value entered in the backward of what takes that output); or, those alike "
    "too, phase parameter_gradient: the first parameter (its name as layer) whose own "
    "gradient differed, the layer called last first; or phase update: a step measuring "
    "updates had its update run again by its optimizer from the same weights, gradients "
    "and state (an update ratio jump's verdict), and this parameter came out different; "
    "and whether "
    "torch's deterministic algorithms were on (always 1)",
)
SPIKE_MISMATCH_TIMESTAMP_SECONDS = Metric(
    "hookprof_spike_mismatch_timestamp_seconds",
    "gauge",
    ("rank",),
    "Unix time at which the spike replay in hookprof_spike_mismatch_info was judged (the "
    "alert fires for 30 minutes from it, whatever the scrapes missed)",
)
INTERNAL_ERRORS_TOTAL = Metric(
    "hookprof_internal_errors_total",
    "counter",
    ("rank", "part"),
    "Internal hookprof errors, by the part that failed (a fault disables only that part, for "
    "that call or step, and it is tried again)",
)
LAYERS = Metric(
    "hookprof_layers",
    "gauge",
    _RANK,
    "Instrumented layers, and compiled regions (blocks compiled on their own) once timed",
)
LAYERS_EXPORTED = Metric(
    "hookprof_layers_exported",
    "gauge",
    _RANK,
    "Layers with per-layer series in this exposition (Config.max_layers, max_layer_series)",
)
FIRST_NONFINITE_INFO = Metric(
    "hookprof_first_nonfinite_info",
    "gauge",
    ("rank", "layer", "phase", "step"),
    "The first NaN or Inf seen in this run: layer, phase and step",
)
FIRST_NONFINITE_ORIGIN_INFO = Metric(
    "hookprof_first_nonfinite_origin_info",
    "gauge",
    ("rank", "phase", "step", "found_by", "replay", "host", "device"),
    "How the first NaN or Inf was settled: how its layer was found (found_by) and what a replay "
    "of its step said (replay: reproducible, transient, not replayed); host and device where it ran",
)
CAPSULES_WRITTEN_TOTAL = Metric(
    "hookprof_capsules_written_total",
    "counter",
    _RANK,
    "Capsules written (Config.capsule_dir) for the first NaN or Inf, a replay check's "
    "mismatch and a spike replay's (hookprof replay re-runs one)",
)
FIRST_NONFINITE_CAPSULE_INFO = Metric(
    "hookprof_first_nonfinite_capsule_info",
    "gauge",
    ("rank", "step", "path"),
    "The incident capsule of the first NaN or Inf: where it was written (path, on the training host)",
)
PUBLISHER_THREAD_UP = Metric(
    "hookprof_publisher_thread_up",
    "gauge",
    _RANK,
    "1 while the background thread that folds sampled steps into snapshots is alive and publishing",
)
BUILD_INFO = Metric(
    "hookprof_build_info",
    "gauge",
    ("version", "torch_version"),
    "hookprof and torch versions",
    per_model=False,
)

# ---- per layer (serve/exporter.py) ----

LAYER_FORWARD_SECONDS = Metric(
    "hookprof_layer_forward_seconds",
    "summary",
    ("rank", "layer", "module"),
    "Forward time per call on sampled steps, excluding instrumented submodules",
)
LAYER_BACKWARD_SECONDS = Metric(
    "hookprof_layer_backward_seconds",
    "summary",
    ("rank", "layer", "module"),
    "Backward time per call on sampled steps, excluding instrumented submodules",
)
LAYER_RECOMPUTE_SECONDS = Metric(
    "hookprof_layer_recompute_seconds",
    "summary",
    ("rank", "layer", "module"),
    "Forward recomputation during backward (activation checkpointing) per call on "
    "sampled steps; only layers that were recomputed. Not part of forward seconds",
)
LAYER_GRADIENT_NORM = Metric(
    "hookprof_layer_gradient_norm",
    "gauge",
    _LAYER,
    "L2 norm of the layer's own parameters' gradients at the last sampled step",
)
LAYER_NONFINITE_TOTAL = Metric(
    "hookprof_layer_nonfinite_total",
    "counter",
    ("rank", "layer", "phase"),
    "Sampled steps on which the layer's outputs (forward) or gradients (backward) "
    "held a NaN or Inf; only layers that ever did",
)
LAYER_GRADIENT_FLAGGED_STEPS_TOTAL = Metric(
    "hookprof_layer_gradient_flagged_steps_total",
    "counter",
    ("rank", "layer", "kind"),
    "Sampled steps on which the layer's gradient norm was vanishing or exploding; "
    "only layers that ever were",
)
LAYER_ACTIVATION_ZERO_RATIO = Metric(
    "hookprof_layer_activation_zero_ratio",
    "gauge",
    _LAYER,
    "Fraction of exact zeros in the layer's outputs at the last sampled step",
)
LAYER_ACTIVATION_ABS_MAX = Metric(
    "hookprof_layer_activation_abs_max",
    "gauge",
    _LAYER,
    "Largest absolute value in the layer's outputs at the last sampled step",
)


def layer_statistic(name: str, help: str) -> Metric:
    """A per-layer statistic the user gave attach(layer_statistics=...) (step/statistics.py):
    hookprof_layer_<name>, a gauge per layer; not in ALL (its name is the user's)."""
    return Metric(f"{LAYER_STATISTIC_PREFIX}{name}", "gauge", _LAYER, help)


LAYER_STATISTIC_PREFIX = "hookprof_layer_"

# ---- efficiency (efficiency/families.py; docs/efficiency.md) ----

LAYER_FORWARD_FLOPS = Metric(
    "hookprof_layer_forward_flops",
    "gauge",
    _LAYER,
    "FLOPs per forward call of the layer (torch.utils.flop_counter, counted once per input shape)",
)
LAYER_BACKWARD_FLOPS = Metric(
    "hookprof_layer_backward_flops",
    "gauge",
    _LAYER,
    "FLOPs of the backward of one call of the layer",
)
LAYER_FLOPS_PER_SECOND = Metric(
    "hookprof_layer_flops_per_second",
    "gauge",
    _LAYER,
    "Achieved FLOP/s of the layer at the last sampled step: its FLOPs over its measured "
    "forward and backward time",
)
LAYER_WEIGHT_NORM = Metric(
    "hookprof_layer_weight_norm",
    "gauge",
    _LAYER,
    "L2 norm of the layer's own parameters after the last sampled step's update",
)
LAYER_UPDATE_NORM = Metric(
    "hookprof_layer_update_norm",
    "gauge",
    _LAYER,
    "L2 norm of the change the optimizer made to the layer's parameters, at the last "
    "sampled step that measured it",
)
LAYER_UPDATE_RATIO = Metric(
    "hookprof_layer_update_ratio",
    "gauge",
    _LAYER,
    "Update norm over weight norm of the layer, at the last sampled step that measured it",
)
MODEL_FLOPS_PER_SECOND = Metric(
    "hookprof_model_flops_per_second",
    "gauge",
    _RANK,
    "Achieved FLOP/s of the model: FLOPs of a training step over the mean wall time of the "
    "steps since the sampled step before",
)
MODEL_FLOPS_UTILIZATION_RATIO = Metric(
    "hookprof_model_flops_utilization_ratio",
    "gauge",
    _RANK,
    "Model FLOPs utilisation: achieved FLOP/s over the device's peak (Config.peak_flops, or "
    "the known GPU's); absent when the peak is unknown",
)
UPDATE_RATIO = Metric(
    "hookprof_update_ratio",
    "gauge",
    _RANK,
    "Global update-to-weight ratio: sqrt of summed squared update norms over summed squared "
    "weight norms, over every layer's latest measurement",
)

# ---- phases, progress and stalls (phases/families.py; docs/stalls.md) ----

STEP_PHASE_SECONDS = Metric(
    "hookprof_step_phase_seconds",
    "summary",
    ("rank", "phase"),
    "Host seconds of each step spent per phase: data (previous step's end to the first "
    "root forward), forward, backward, optimizer, other; every step (docs/stalls.md)",
)
STEP_PHASE_DEVICE_SECONDS = Metric(
    "hookprof_step_phase_device_seconds",
    "summary",
    ("rank", "phase"),
    "Device seconds of sampled steps per phase: the CUDA stream's progress between the "
    "host's phase boundaries (work enqueued in a phase, or the device idling for the "
    "host); only with CUDA events, absent on the CPU where it would equal "
    "hookprof_step_phase_seconds (docs/stalls.md)",
)
STALLED = Metric(
    "hookprof_stalled",
    "gauge",
    _RANK,
    "1 while the training thread's current phase has lasted longer than the stall "
    "threshold learned for it (hookprof_stall_info says where)",
)
STALLS_TOTAL = Metric("hookprof_stalls_total", "counter", _RANK, "Stalls seen since attach")
PROGRESS_STEP = Metric(
    "hookprof_progress_step", "gauge", _RANK, "The step in progress (steps completed + 1)"
)
PROGRESS_PHASE = Metric(
    "hookprof_progress_phase",
    "gauge",
    ("rank", "phase"),
    "The training thread's current phase (label); the value is its order in a step "
    "(data 0, forward 1, backward 2, optimizer 3, other 4, outside a step -1)",
)
PROGRESS_PHASE_SECONDS = Metric(
    "hookprof_progress_phase_seconds",
    "gauge",
    _RANK,
    "Seconds the training thread has been in its current phase",
)
STALL_INFO = Metric(
    "hookprof_stall_info",
    "gauge",
    ("rank", "step", "phase", "layer", "waiting_on"),
    "The stall going on now: step, phase, innermost layer on the training thread's "
    "stack, and what it waits on (collective, data, device, code)",
)

# ---- the endpoint's own (serve/server.py) ----

HTTP_CONNECTIONS_REJECTED_TOTAL = Metric(
    "hookprof_http_connections_rejected_total",
    "counter",
    ("reason",),
    "Connections to the metrics endpoint refused or closed before a response, by reason "
    "(limits and timeouts: Config.http_*)",
    per_model=False,
)
METRICS_PORT_CONFLICT_INFO = Metric(
    "hookprof_metrics_port_conflict_info",
    "gauge",
    ("wanted_port", "holder"),
    "Present when the configured metrics port was taken and this endpoint serves on a free port "
    "instead (Config.port_conflict): the port wanted and the process that held it",
    per_model=False,
)

# ---- host, GPUs and CUDA memory (serve/system.py), once per endpoint ----

HOST_CPU_UTILIZATION_RATIO = Metric(
    "hookprof_host_cpu_utilization_ratio",
    "gauge",
    (),
    "Host CPU utilisation over the last interval, 0-1 (psutil)",
    per_model=False,
)
HOST_MEMORY_TOTAL_BYTES = Metric(
    "hookprof_host_memory_total_bytes",
    "gauge",
    (),
    "Host physical memory (psutil)",
    per_model=False,
)
HOST_MEMORY_AVAILABLE_BYTES = Metric(
    "hookprof_host_memory_available_bytes",
    "gauge",
    (),
    "Host memory available without swapping (psutil)",
    per_model=False,
)

# dcgm-exporter's label spellings, so `* on(gpu, UUID)` joins; not its camelCase modelName,
# which promtool's lint rejects (the UUID identifies the device anyway)
_GPU = ("gpu", "UUID")
GPU_UTILIZATION_RATIO = Metric(
    "hookprof_gpu_utilization_ratio", "gauge", _GPU, "GPU utilisation (NVML), 0-1", per_model=False
)
GPU_MEMORY_USED_BYTES = Metric(
    "hookprof_gpu_memory_used_bytes",
    "gauge",
    _GPU,
    "GPU memory in use on the device, all processes (NVML)",
    per_model=False,
)
GPU_MEMORY_TOTAL_BYTES = Metric(
    "hookprof_gpu_memory_total_bytes",
    "gauge",
    _GPU,
    "GPU memory on the device (NVML)",
    per_model=False,
)
GPU_POWER_WATTS = Metric(
    "hookprof_gpu_power_watts", "gauge", _GPU, "GPU power draw (NVML)", per_model=False
)
GPU_TEMPERATURE_CELSIUS = Metric(
    "hookprof_gpu_temperature_celsius",
    "gauge",
    _GPU,
    "GPU core temperature (NVML)",
    per_model=False,
)
GPU_ENERGY_JOULES_TOTAL = Metric(
    "hookprof_gpu_energy_joules_total",
    "counter",
    _GPU,
    "GPU energy since the driver was loaded (NVML)",
    per_model=False,
)

_DEVICE = ("rank", "device")
CUDA_MEMORY_ALLOCATED_BYTES = Metric(
    "hookprof_cuda_memory_allocated_bytes",
    "gauge",
    _DEVICE,
    "Memory held by this process's tensors (torch.cuda.memory_allocated)",
    per_model=False,
)
CUDA_MEMORY_RESERVED_BYTES = Metric(
    "hookprof_cuda_memory_reserved_bytes",
    "gauge",
    _DEVICE,
    "Memory held by this process's caching allocator (torch.cuda.memory_reserved)",
    per_model=False,
)
CUDA_MEMORY_PEAK_ALLOCATED_BYTES = Metric(
    "hookprof_cuda_memory_peak_allocated_bytes",
    "gauge",
    _DEVICE,
    "Peak of allocated bytes since start or reset (torch.cuda.max_memory_allocated)",
    per_model=False,
)

# ---- the process: prometheus_client's ProcessCollector where there is /proc, else
# serve/system.py's PsutilProcessCollector under the same names and help ----

PROCESS_CPU_SECONDS_TOTAL = Metric(
    "process_cpu_seconds_total",
    "counter",
    (),
    "Total user and system CPU time spent in seconds.",
    per_model=False,
)
PROCESS_RESIDENT_MEMORY_BYTES = Metric(
    "process_resident_memory_bytes", "gauge", (), "Resident memory size in bytes.", per_model=False
)
PROCESS_VIRTUAL_MEMORY_BYTES = Metric(
    "process_virtual_memory_bytes", "gauge", (), "Virtual memory size in bytes.", per_model=False
)
PROCESS_OPEN_FDS = Metric(
    "process_open_fds", "gauge", (), "Number of open file descriptors.", per_model=False
)
PROCESS_MAX_FDS = Metric(
    "process_max_fds",
    "gauge",
    (),  # ProcessCollector's only
    "Maximum number of open file descriptors.",
    per_model=False,
)
PROCESS_START_TIME_SECONDS = Metric(
    "process_start_time_seconds",
    "gauge",
    (),
    "Start time of the process since unix epoch in seconds.",
    per_model=False,
)

ALL: tuple[Metric, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Metric))
BY_NAME: dict[str, Metric] = {m.name: m for m in ALL}
