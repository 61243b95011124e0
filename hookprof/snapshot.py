"""The Snapshot: the immutable, host-side picture of a run that users and the exporter read.

`Profiler.snapshot()` returns it and the exporter renders it; the background thread
publishes it as a whole (one reference swap)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, NamedTuple

PHASES = ("forward", "backward", "loss")
LAYER_PHASES = ("forward", "backward")

# step durations from 1 ms to 2 min: fast CPU loops to slow pipeline-parallel steps
STEP_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class LayerStats:
    """One instrumented module. Times exclude instrumented submodules (so layers sum to no
    more than the step), and add up over every call of the module in a step."""

    name: str
    """Qualified name from named_modules() ("(root)" for the root module)."""
    module: str
    """Class name, e.g. "Linear"."""
    calls: int = 0
    """Forward calls in the last sampled step."""
    forward_seconds: float = 0.0
    """Forward time in the last sampled step."""
    backward_seconds: float = 0.0
    """Backward time in the last sampled step (gradient at the outputs to gradient at the
    inputs, or to the parameters' gradients for a layer whose inputs need none)."""
    grad_norm: float | None = None
    """L2 norm of the layer's own parameters' gradients at the last sampled step."""
    activation_zero_ratio: float | None = None
    """Fraction of exact zeros in the layer's floating outputs, last sampled step."""
    activation_abs_max: float | None = None
    """Largest |value| in the layer's floating outputs, last sampled step."""
    forward_seconds_total: float = 0.0
    forward_calls_total: int = 0
    backward_seconds_total: float = 0.0
    backward_calls_total: int = 0
    forward_seconds_per_call_median: float | None = None
    """The median of the forward's mean time per call over the last 5 sampled steps that
    called the layer (publish/recent.py) (None until there are that many): a rank's robust recent
    figure, which the layer straggler rule compares across ranks (exported as the timing
    summary's quantile="0.5")."""
    backward_seconds_per_call_median: float | None = None
    """The same for the backward."""
    recompute_seconds: float = 0.0
    """Forward recomputation in the last sampled step's backward (activation checkpointing);
    never counted in forward_seconds."""
    recompute_seconds_total: float = 0.0
    recompute_calls_total: int = 0
    nonfinite: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Phase ("forward": outputs, "backward": gradients) -> steps on which the layer held a
    NaN or Inf."""
    gradient_flags: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """"vanishing" / "exploding" -> sampled steps on which the layer's gradient norm was
    below Config.vanishing_grad_norm / above Config.exploding_grad_norm."""


class WordEnum(str, Enum):
    """A name for each of a few fixed words (enum.StrEnum from Python 3.11): equal to its
    word, and written as it (str(), f-strings, JSON, metric labels)."""

    __str__ = str.__str__

    def __format__(self, spec: str) -> str:
        return str.__format__(self.value, spec)


class FoundBy(WordEnum):
    """How an incident's first layer was found (NonFiniteEvent.found_by)."""

    SAMPLED = "sampled step"
    REPLAY = "replay"
    WEIGHTS = "non-finite weights"
    INPUT = "input"
    BACKWARD = "backward check"
    LOSS = "loss check"


class ReplayOutcome(WordEnum):
    """What the replay of a forward NaN's step said (NonFiniteEvent.replay)."""

    REPRODUCIBLE = "reproducible"
    TRANSIENT = "transient"
    NOT_REPLAYED = "not replayed"


@dataclass(frozen=True, slots=True)
class NonFiniteEvent:
    """The first NaN/Inf of a run. `step` and `phase` are exact (device counters, every
    step). `layer` is what produced it: for "forward", "(input)" when the root module's
    inputs already held it, else the innermost module call with finite inputs and a
    non-finite output (a layer, or a container module whose own code made it between its
    children's calls); for "backward", the first layer whose gradient went
    non-finite; "(loss)" for the loss alone; None while not yet localised (a forward NaN on a
    step without per-layer checks: hookprof then samples every step to find it)."""

    layer: str | None
    phase: str
    step: int
    propagators: tuple[str, ...] = ()
    """Layers the value flowed through on the step where the layer was found."""
    last_finite_child: str | None = None
    """For a producer that is a container module (its own code made the value between its
    children's calls): the last of its children whose output was still finite."""
    found_by: FoundBy | None = None
    """How `layer` was found (FoundBy): "sampled step" (that step's per-layer checks saw a
    finite input and a non-finite output), "replay" (the step's forward run again with the
    same inputs, weights and RNG did), "non-finite weights" (the layer's own weights were
    non-finite before any non-finite update was applied: the cause), "input" (the batch
    already held it), "backward check" (the first gradient to go non-finite), "loss check".
    None while no layer is named."""
    replay: ReplayOutcome | None = None
    """What the replay of a forward NaN's step said (ReplayOutcome): "reproducible" (it made
    the NaN again: the data or the model), "transient" (with the same inputs, weights and RNG
    it was finite: a non-deterministic kernel, a race, or the hardware), "not replayed" (see
    `replay_note`). None: not replayed yet, or not a forward NaN."""
    replay_note: str | None = None
    """Why the step was not replayed."""
    device: str = "cpu"
    """Where the step ran: "cpu", or the GPU's UUID (so a platform team can drain it)."""
    capsule: str | None = None
    """The incident capsule's path (Config.capsule_dir; `hookprof replay` re-runs it), once
    written."""


@dataclass(frozen=True, slots=True)
class DroppedNonFinite:
    """Steps whose backward made non-finite gradients that the loop dropped before any
    optimizer update: a loss scaler's overflow (DeepSpeed's, Megatron's, one's own; torch's
    GradScaler skips are `Snapshot.skipped_steps`), a guard that zeroes them. No incident
    (nothing non-finite reached the weights), but counted, and the first one's layers named
    (issue 38)."""

    steps: int
    """How many steps."""
    first_step: int
    """The first of them."""
    layer: str | None
    """The first layer whose gradient was non-finite at `first_step` (in backward's
    order: the last in module order); None when its values had not arrived."""
    others: tuple[str, ...] = ()
    """The other layers non-finite at `first_step`."""


@dataclass(frozen=True, slots=True)
class LayerEfficiency:
    """One layer's FLOPs and norms at the last sampled step that measured them (None: not
    measured, e.g. a layer without parameters has no weight norm)."""

    forward_flops: float | None = None
    """FLOPs per forward call (counted on meta tensors, once per input shape)."""
    backward_flops: float | None = None
    """FLOPs per backward of a call."""
    flops_per_second: float | None = None
    """FLOPs of the layer's calls over their measured forward and backward time."""
    weight_norm: float | None = None
    """L2 norm of the layer's own parameters after the update."""
    update_norm: float | None = None
    """L2 norm of the change the optimizer step made to them."""
    update_ratio: float | None = None
    """update_norm / weight_norm of the same step."""


@dataclass(frozen=True, slots=True)
class EfficiencyStats:
    layers: Mapping[str, LayerEfficiency] = field(default_factory=lambda: _EMPTY)
    flops_per_step: float | None = None
    """FLOPs of one training step (forward and backward of every counted layer)."""
    flops_per_second: float | None = None
    """flops_per_step over the mean wall time of the steps since the sampled step before."""
    flops_utilization: float | None = None
    """flops_per_second over the device's peak (Config.peak_flops, or the known GPU's)."""
    update_ratio: float | None = None
    """sqrt(sum of squared update norms / sum of squared weight norms) over every layer's
    latest measurement."""


# the kinds of spike (publish/spikes.py), as metric labels: the every-step series' two, and
# a layer's update-to-weight ratio on the steps that measure it
SPIKE_KINDS = ("loss_spike", "grad_norm_spike", "update_ratio_jump")


class Suspect(NamedTuple):
    """A sample of a spike's batch (Config.spike_replay, `prof.step(loss, sample_losses=...)`):
    its index in the batch and its loss (the sum of its elements' losses)."""

    sample: int
    loss: float


def suspects_from(values: Sequence[float]) -> tuple[tuple[Suspect, ...], float]:
    """A batch's samples of largest loss as the spike replay reads them from the device (k
    losses, largest first, their k indices, then the batch's total:
    integrity/spike_replay.py `suspects_of`): (the samples, the total)."""
    k = (len(values) - 1) // 2
    found = tuple(Suspect(int(i), float(v)) for v, i in zip(values[:k], values[k : 2 * k]))
    return found, float(values[2 * k])


@dataclass(frozen=True, slots=True)
class SpikeEvent:
    """One spike of the loss, the global gradient norm or a layer's update-to-weight ratio
    (publish/spikes.py): its first step, the value there, the median of the window it was
    judged against, and its robust z-score."""

    step: int
    value: float
    median: float
    z: float
    layer: str | None = None
    """An update ratio jump's layer (the one whose z-score was highest at that step)."""
    verdict: str | None = None
    """Its step's replay (Config.spike_replay, integrity/spike_replay.py): "reproduced" (the
    data), "not_reproduced" (the machine), "not_compared"; None: not replayed (yet)."""
    capsule: str | None = None
    """A not-reproduced replay's capsule (capsule_dir set), for `hookprof replay`."""
    entered: str | None = None
    """A not-reproduced replay's first layer, in call order, whose forward output differed from
    the step's: where the wrong value entered ("(root)": the model's own code between its
    layers); with `entered_phase` "backward", the first layer, in the order the backward
    computed them, whose output's gradient differed (its forward was alike): the wrong value
    entered in the backward of what takes that output (the next layer, in a chain); with
    "parameter_gradient", the first parameter (by name; its layer's backward, last called
    first) whose own gradient differed, the outputs and their gradients all alike (a
    weight-gradient kernel); with "update" (an update ratio jump: its step's update run
    again by the optimizer, integrity/update_replay.py), the first parameter whose update
    came out different."""
    entered_phase: str | None = None
    """"forward", "backward", "parameter_gradient" or "update": where `entered` differed
    (None with no `entered`)."""
    suspects: tuple[Suspect, ...] | None = None
    """Its batch's samples of largest loss, the largest first (`prof.step(loss,
    sample_losses=...)` given on its step): with a reproduced verdict, the data to look at."""


@dataclass(frozen=True, slots=True)
class ParameterFingerprint:
    """The parameters' fingerprint after one step's update (hookprof/integrity/): replicas of
    one data-parallel job hold the same `value` at the same `step`."""

    step: int
    value: int
    """52 bits of a wrapping integer sum of the parameters' bits (integrity/fingerprint.py)."""
    replica_group: str
    """A hash of the run, the parameters' names, shapes and dtypes and Config.sdc_replica_group
    (integrity/fingerprint.py replica_group): only ranks of the same group are compared."""


@dataclass(frozen=True, slots=True)
class ParameterChange:
    """A check step on which this rank's parameters changed between its forward and its
    update (integrity/replicas.py): written outside the optimizer, by the rank's memory or
    device, or by the loop's own code."""

    step: int
    parameter: str
    """The first parameter, in the model's `named_parameters` order, whose bits changed."""
    changed: int
    """How many parameters changed: one or a few is what a flipped bit does; many, a write of
    the loop's own that torch did not see (through `.data`)."""
    time: float = 0.0
    """When the publisher judged it (Unix seconds): the alert's 30 minutes count from it."""


@dataclass(frozen=True, slots=True)
class ReplayMismatch:
    """A check step whose replay did not reproduce its forward: the first layer, in call
    order, whose output differed (or, when the two forwards called different layers before
    any output differed, the layer called where they parted)."""

    step: int
    layer: str
    deterministic: bool
    """Were torch's deterministic algorithms on? Off, a nondeterministic kernel is a suspect
    beside the device."""
    time: float = 0.0
    """When the publisher judged it (Unix seconds): the alert's 30 minutes count from it."""
    capsule: str | None = None
    """Its capsule's path (capsule_dir set), for `hookprof replay` in another process."""
    phase: str = "forward"
    """"backward": `layer` is the first layer whose output's *gradient* differed, in the order
    the backward computed them, the forward alike (the spike replay's backward comparison);
    "parameter_gradient": `layer` is the first parameter whose own gradient differed, all
    else alike; "update": `layer` is the first parameter whose update, run again by its
    optimizer from the same weights, gradients and state, came out different."""


@dataclass(frozen=True, slots=True)
class SpikeCount:
    """The events of one kind so far: how many, the first and the latest."""

    count: int = 0
    first: SpikeEvent | None = None
    last: SpikeEvent | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    rank: int = 0
    step: int = 0
    """Steps completed."""
    sampled_steps: int = 0
    sampled_step_seconds: float = 0.0
    """Wall time summed over the sampled steps: what a layer's share of the step is of (its
    times come from the same steps)."""
    last_sampled_step: int | None = None
    step_duration_buckets: tuple[tuple[float, int], ...] = ()
    """(upper bound in seconds, cumulative count), ending with (inf, step)."""
    step_duration_sum: float = 0.0
    last_step_timestamp: float | None = None
    """Unix time at which the last step ended."""
    loss: float | None = None
    """Loss at the last sampled step that was given one (Profiler.step(loss=...))."""
    grad_norm: float | None = None
    """Global L2 norm of all gradients at the last sampled step."""
    nonfinite_steps: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({p: 0 for p in PHASES})
    )
    skipped_steps: int = 0
    held_back_updates: int = 0  # non-finite updates held back (on_nonfinite "skip"/"raise")
    capsules_written: int = 0  # incident and replay-check capsules written (Config.capsule_dir)
    internal_errors: int = 0
    layers: Mapping[str, LayerStats] = field(default_factory=lambda: _EMPTY)
    """Every instrumented layer by qualified name, in named_modules() order."""
    exported_layers: tuple[str, ...] = ()
    """The layers the exporter shows with every figure (all of them up to Config.max_layers
    and Config.max_layer_series, or Config.detailed_layers of them at scale)."""
    timed_layers: tuple[str, ...] = ()
    """The layers the exporter shows with their time alone (Config.detailed_layers)."""
    first_nonfinite: NonFiniteEvent | None = None
    """The first non-finite value seen: layer, phase and step."""
    dropped_nonfinite: DroppedNonFinite | None = None
    """Non-finite gradients the loop dropped before any update (no incident); None: none."""
    gradient_flagged_steps: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    parameter_fingerprint: ParameterFingerprint | None = None
    """The replica check's last fingerprint of the parameters (Config.sdc_check_interval_s)."""
    parameter_changes: int | None = None
    """Check steps on which the parameters changed between the forward and the update (None:
    the check is off)."""
    parameter_change: ParameterChange | None = None
    """The last of those."""
    parameter_watches: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Check steps whose parameters were watched from the forward to the update, by result
    ("compared", "not_compared": no update hook, a closure's forward, a compiled model's,
    a parameter replaced); empty while the check is off."""
    replay_checks: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """The replay check's steps by result ("reproduced", "not_reproduced", "not_compared");
    empty while the check is off (Config.sdc_check_interval_s)."""
    replay_mismatch: ReplayMismatch | None = None
    """The last check step whose replay did not reproduce its forward."""
    spike_replays: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """The spike replay's steps by result ("reproduced": the data, "not_reproduced": the
    machine, "not_compared"); empty while it is off (Config.spike_replay). Each spike event
    carries its step's verdict (SpikeEvent.verdict)."""
    spike_mismatch: ReplayMismatch | None = None
    """The last spike whose replay did not reproduce its forward: the first layer whose output
    differed ("(root)": only the model's output, from its own code between its children)."""
    spikes: Mapping[str, SpikeCount] = field(default_factory=lambda: _EMPTY)
    """"loss_spike" / "grad_norm_spike" -> the spike events of the every-step series so far
    (publish/spikes.py): anomalies that are no NaN."""
    notices: tuple[str, ...] = ()
    """What hookprof could not see in this set-up (each also logged once): a figure it
    names is missing for that reason, not measured as None or zero."""
    """"vanishing" / "exploding" -> sampled steps on which any layer was flagged."""

    def __str__(self) -> str:
        """The per-layer table a person reads (hookprof/table.py): `print(prof.snapshot())`,
        under a line that names the model and the step it is as of: the snapshot is published
        by a background thread, so right after training it may be a step or so behind
        (`prof.flush()` first, or `prof.report()`, for up to now)."""
        from hookprof.view.table import from_snapshot, render

        as_of = (
            f"hookprof snapshot of {self.model or 'a model'}, rank {self.rank}, as of step {self.step} "
            "(published in the background: prof.flush() first, or prof.report(), for up to now)"
        )
        return as_of + "\n" + render([from_snapshot(self, self.model)])

    def __repr__(self) -> str:
        bad = sum(self.nonfinite_steps.values())
        return (
            f"<hookprof.Snapshot rank={self.rank} step={self.step} sampled={self.sampled_steps} "
            f"layers={len(self.layers)} loss={self.loss!r} grad_norm={self.grad_norm!r} "
            f"nonfinite_steps={bad}>"
        )

    phase_seconds: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """Step phase ("data", "forward", "backward", "optimizer", "other") -> host seconds
    summed over `phase_steps` steps (docs/stalls.md); they add up to step_duration_sum."""
    phase_steps: int = 0
    progress: StepProgress | None = None
    """Where the training thread is now (as of this snapshot)."""
    stall: StallReport | None = None
    """The stall going on now, if any (docs/stalls.md)."""
    stalls: int = 0
    """Stalls seen since attach."""
    efficiency: EfficiencyStats | None = None
    """FLOPs, achieved FLOP/s and weight/update norms (None when both features are off)."""
    device_phase_seconds: Mapping[str, float] | None = None
    """Step phase -> device seconds summed over `device_phase_steps` sampled steps: the CUDA
    stream's progress between the phase's boundaries (docs/stalls.md). None unless the timer
    is a device timer (on the host clock it would repeat `phase_seconds`)."""
    device_phase_steps: int = 0
    layer_statistics: Mapping[str, LayerStatisticValues] = field(default_factory=lambda: _EMPTY)
    """The per-layer statistics, hookprof's own (step/builtin_statistics.py: activation_abs_max,
    activation_zero_ratio) and those given to attach(layer_statistics=...): name -> its help
    and each exported layer's value at the last sampled step with activation statistics (a
    statistic of outputs) or at the last sampled step's end (of parameters)."""
    model: str = ""
    """The model's name (its `model` label: Config.name, by default its class name)."""


@dataclass(frozen=True, slots=True)
class LayerStatisticValues:
    """One per-layer statistic's last values (step/statistics.py)."""

    help: str
    values: Mapping[str, float]
    """layer -> value, for the exported layers the statistic saw."""


@dataclass(frozen=True, slots=True)
class StepProgress:
    """The training thread's position: the step in progress (steps completed + 1), its
    phase ("data", "forward", "backward", "optimizer", "other", or "outside" a step: an
    evaluation pass, an expect_slow section, before the first step) and for how long."""

    step: int
    phase: str
    phase_seconds: float
    label: str | None = None
    """What an "outside" section is: "eval", "start", or the name given to expect_slow."""


@dataclass(frozen=True, slots=True)
class StallReport:
    """A phase that lasted more than Config.stall_factor times its typical duration (within
    Config.stall_min_s and stall_max_s), read once when it was judged a stall."""

    step: int
    phase: str
    layer: str
    """Innermost module of the model on the training thread's stack, "(unknown)" when none
    is (a backward pass runs in C++; data loading runs outside the model)."""
    waiting_on: str
    """"collective" (a collective in flight, or torch.distributed on the stack), "data" (a
    DataLoader on the stack), "device" (the GPU's stream still busy), else "code"."""
    seconds: float
    """How long the phase had lasted when it was judged a stall."""
    threshold_seconds: float
    typical_seconds: float
    started_at: float
    """Unix time at which the phase began."""
    stack: tuple[str, ...] = ()
    """The training thread's Python stack, outermost first ("file:line in function")."""
    collectives: tuple[str, ...] = ()
    """The rank's last collectives from torch's flight recorder, when it is on."""


def timing_series(layer: LayerStats) -> int:
    """The series of a layer on the page with its time alone (Config.detailed_layers): a
    timing summary's _sum and _count for each of forward, backward and recompute where it was
    called, and the forward's and backward's recent median per call where known. Part of
    `layer_series`."""
    return 2 * sum(
        1
        for calls in (
            layer.forward_calls_total,
            layer.backward_calls_total,
            layer.recompute_calls_total,
        )
        if calls
    ) + sum(
        1
        for median in (
            layer.forward_seconds_per_call_median,
            layer.backward_seconds_per_call_median,
        )
        if median is not None
    )


def layer_series(layer: LayerStats, efficiency: LayerEfficiency | None, statistics: int = 0) -> int:
    """The series one exported layer puts on a /metrics page, by the exporter's own rules
    (serve/exporter.py: a timing summary's _sum and _count where it was called, a gauge where
    its value is known, a counter where it is not 0; efficiency/families.py: one per known
    figure), plus `statistics`: the per-layer statistics with a value for it (hookprof's
    own activation abs max, zero ratio, weight and update norms and update ratio among them:
    step/builtin_statistics.py). What the
    series budget (Config.max_layer_series) counts; docs/metrics.md has the totals."""
    n = timing_series(layer)
    n += int(layer.grad_norm is not None)
    n += sum(1 for count in layer.nonfinite.values() if count)
    n += sum(1 for count in layer.gradient_flags.values() if count)
    if efficiency is not None:
        n += sum(
            1
            for v in (
                efficiency.forward_flops,
                efficiency.backward_flops,
                efficiency.flops_per_second,
            )
            if v is not None
        )
    return n + statistics
