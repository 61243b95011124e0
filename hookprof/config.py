"""hookprof's configuration: one dataclass, and the one place environment variables are read."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hookprof.errors import ConfigError
from hookprof.snapshot import WordEnum

ENV_PREFIX = "HOOKPROF_"

# 8479 lies outside 9100-9999, the range of the Prometheus "default port allocations" list,
# so it clashes with no registered exporter (node_exporter 9100, dcgm-exporter 9400, ...).
DEFAULT_PORT = 8479
NonfiniteCheck = Literal["all", "loss"]
NonfinitePolicy = Literal["record", "warn", "raise", "dump", "skip"]
NONFINITE_CHECKS: tuple[str, ...] = typing.get_args(NonfiniteCheck)
NONFINITE_POLICIES: tuple[str, ...] = typing.get_args(NonfinitePolicy)


class Policy(WordEnum):
    """The words of `on_nonfinite`, named where hookprof compares them (a user's "warn" is
    equal to Policy.WARN: the field stays a plain word)."""

    RECORD = "record"
    WARN = "warn"
    RAISE = "raise"
    DUMP = "dump"
    SKIP = "skip"


assert tuple(Policy) == NONFINITE_POLICIES, "Policy and NonfinitePolicy name the same words"
PortConflict = Literal["free", "off", "raise"]
PORT_CONFLICTS: tuple[str, ...] = typing.get_args(PortConflict)


_DAY = 86400.0
# the shortest interval of a thread that wakes on a clock (the publisher, the system sampler):
# below 0.05 s they take a share of a core of their own while training idles (1e-9 took
# 0.4-0.9 of a core and made steps 2-7x slower, issue 39); at 0.05 s each stays under ~1%
# (docs/configuration.md)
MIN_THREAD_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class Rule:
    """What one field's value must be, kept beside the field (`_ruled`). None, where the
    field's type allows it, passes every rule. `high` is checked first and says "a finite
    number": every interval and threshold is bounded, so that an inf (or 1e300) is named
    here rather than killing the thread that waits on it (OverflowError) later."""

    low: float | None = None  # at least
    above: float | None = None  # more than
    high: float | None = None  # at most (and so finite: nan fails it too)
    holds: Callable[[Any], bool] | None = None  # any other test of the value alone
    words: str | None = None  # what is expected, where low/above do not say it

    def expected(self, value: Any, nullable: bool) -> str | None:
        """None when `value` keeps the rule; else what the field must be."""
        if value is None:
            return None
        if self.high is not None and not value <= self.high:
            return f"a finite number <= {self.high:g}"
        if (
            (self.low is None or value >= self.low)
            and (self.above is None or value > self.above)
            and (self.holds is None or self.holds(value))
        ):
            return None
        if self.words is not None:
            return self.words
        bound = f">= {self.low:g}" if self.low is not None else f"> {self.above:g}"
        return bound + (" or None" if nullable else "")


def _ruled(default: Any, *rules: Rule) -> Any:
    """A field's default with the rules its value must keep (in the field's metadata)."""
    return dataclasses.field(default=default, metadata={"rules": rules})


_THREAD_INTERVAL = Rule(
    low=MIN_THREAD_INTERVAL_S,
    high=3600.0,
    words=f">= {MIN_THREAD_INTERVAL_S:g} (seconds: a thread waking more often takes a share "
    "of a core of its own)",
)
_EXISTING_FILE = Rule(holds=os.path.isfile, words="a path to an existing file")
_ADDRESS_WORDS = "an IPv4 or IPv6 address or a host name (e.g. 127.0.0.1, ::1, 0.0.0.0, localhost)"


@dataclass(kw_only=True, frozen=True, slots=True)
class Config:
    """Everything a user can set. Each field can also come from `HOOKPROF_<FIELD>`."""

    port: int = _ruled(
        DEFAULT_PORT, Rule(holds=lambda v: 0 <= v <= 65535, words="an integer in [0, 65535]")
    )
    """TCP port of the /metrics endpoint. Under torchrun each process serves
    `port + LOCAL_RANK`. 0 picks a free port (read it back from `Profiler.url`)."""

    addr: str = _ruled(
        "127.0.0.1",
        Rule(holds=lambda a: bool(a.strip()), words="a non-empty host address"),
        Rule(holds=lambda a: _is_address(a), words=_ADDRESS_WORDS),
    )
    """Address the metrics server binds. Loopback by default: set "0.0.0.0" (or a pod IP)
    to let a Prometheus on another host scrape it."""

    name: str | None = _ruled(
        None,
        Rule(holds=lambda n: bool(n.strip()), words="a non-empty name, or None for the class name"),
    )
    """The `model` label of this model's series: by default its class name. Made unique in
    the process (a second `Net` is served as `Net-2`), as every model of a process shares one
    endpoint."""

    serve: bool = True
    """Start the HTTP server. With False, register `Profiler.collector` in your own
    prometheus_client registry instead."""

    port_conflict: PortConflict = "free"
    """When `port` is taken by another process: "free" logs one error naming the port and
    its holder and serves on a free port the system picks (the log and `Profiler.url` say
    which; hookprof_metrics_port_conflict_info on that page says it happened), "off" logs
    it and serves nothing, "raise" raises hookprof.PortInUseError at attach. Training goes
    on under "free" and "off": a metrics port is not worth a run."""

    tls_certfile: str | None = _ruled(None, _EXISTING_FILE)
    """PEM certificate: serve /metrics over HTTPS (with `tls_keyfile`)."""

    tls_keyfile: str | None = _ruled(None, _EXISTING_FILE)
    """PEM private key of `tls_certfile`."""

    tls_client_cafile: str | None = _ruled(None, _EXISTING_FILE)
    """PEM CA bundle: when set, only clients presenting a certificate signed by it can
    connect (mutual TLS; Prometheus: `tls_config.cert_file`/`key_file`). Needs TLS on."""

    http_max_requests: int = _ruled(40, Rule(low=1))
    """Requests answered at once (one short-lived thread each, node_exporter's
    `--web.max-requests` default). A complete request beyond it is answered 503 at once."""

    http_max_connections: int = 128
    """Connections held open at once, idle ones included (one file descriptor each: the
    training process needs its own). A new connection beyond it closes the oldest one that
    is not being answered. Must be above `http_max_requests`."""

    http_header_timeout_s: float = _ruled(10.0, Rule(above=0, high=_DAY))
    """A connection must complete its TLS handshake and send a whole request head within
    this many seconds of being accepted (or of a keep-alive request's first byte)."""

    http_idle_timeout_s: float = _ruled(120.0, Rule(above=0, high=_DAY))
    """A keep-alive connection with no new request for this long is closed. Above the
    usual 60 s scrape interval, so Prometheus reuses its connection."""

    http_write_timeout_s: float = _ruled(10.0, Rule(above=0, high=_DAY))
    """A response must be taken by the client within this many seconds (Prometheus's
    default scrape timeout), or the connection is closed."""

    sample_every: int = _ruled(10, Rule(low=1))
    """A step is sampled (per-layer hooks installed) only when at least this many steps
    have passed since the last sampled step ..."""

    min_sample_interval_s: float = _ruled(2.0, Rule(low=0, high=_DAY))
    """... and at least this many seconds. With both defaults a 15 s scrape sees a fresh
    sample whenever a step takes under 1.5 s, and fast loops sample once per 2 s."""

    max_layers: int = _ruled(500, Rule(low=1))
    """Most layers exported per rank. Beyond it: the layers with the most time, plus every
    layer that went non-finite. `hookprof_layers` / `hookprof_layers_exported` tell."""

    max_layer_series: int = _ruled(10000, Rule(low=1))
    """Most per-layer series on a rank's /metrics page (the budget counts series, not layers:
    a layer exports 4 to 14 with the defaults, docs/metrics.md). Beyond it: every layer that
    went non-finite first (in layer order), then the layers with the most time, while they
    fit. `max_layers` still bounds the number of layers; the default (500 x 20, the most a
    layer exports) leaves `max_layers` the binding one."""

    detailed_layers: int | None = _ruled(None, Rule(low=0))
    """At scale (docs/scale.md): how many layers, beyond those that went non-finite (always
    detailed), export every per-layer figure: the ones with the most forward+backward time.
    The other exported layers export their forward, backward and recompute time alone (with
    the forward's and backward's recent median), the series the layer straggler rule reads.
    None: every exported layer is detailed."""

    activation_stats: bool = True
    """On sampled steps, compute each layer output's zero ratio and absolute maximum
    (which also detects non-finite outputs)."""

    activation_interval_s: float = _ruled(1.0, Rule(low=0, high=_DAY))
    """Activation statistics (and the per-layer output checks that come with them) are taken
    on sampled steps at most this often: with sampling every step they are the costliest
    part, and a gauge refreshed every second is fresh enough. A step without them that goes
    non-finite is localised by replaying its forward."""

    rank: int | None = _ruled(None, Rule(low=0))
    """The `rank` label. None: $RANK, else torch.distributed's rank if initialised, else 0."""

    local_rank: int | None = _ruled(None, Rule(low=0))
    """Offset added to `port`. None: $LOCAL_RANK, else 0."""

    nonfinite_check: NonfiniteCheck = "all"
    """"all": every step, every layer's gradients, the loss and the model's output are checked
    for NaN/Inf on the device (one read of every gradient per step: the physical floor).
    "loss": every step only the loss and the model's output; per-layer gradients on sampled
    steps. Either way nothing waits for the device."""

    on_nonfinite: NonfinitePolicy = "record"
    """What to do when a NaN/Inf is seen: "record" (count and export, never disturb
    training), "warn" (one log line naming layer, phase and step), "raise" (raise
    hookprof.NonFiniteError at the next step boundary), "dump" (write a JSON report of every
    layer to `dump_dir`, keep training), "skip" (hold back the update of every step whose
    output or gradients are non-finite, count it, and train on with intact weights). Under
    "raise" and "skip" a non-finite update never reaches the weights or the optimizer
    state: exact on the CPU and, on an accelerator, for fused optimizers (fused=True); see
    `nonfinite_sync` for the others. Every policy but "record" reads one flag per step back
    from the device, asynchronously."""

    nonfinite_sync: bool = False
    """On an accelerator, wait at each optimizer step for this step's one NaN/Inf flag of the
    model's output, so that a forward NaN's producer is named by a replay before the update
    under any policy, and under "raise"/"skip" a non-fused optimizer's non-finite update is
    held back. Costs a wait for the device at each optimizer step (under "raise"/"skip"
    with a non-fused optimizer, two: the output flag, then the gradients' flag, which the
    device reaches later); off by default."""

    dump_dir: str = "hookprof-dumps"
    """Where on_nonfinite="dump" writes its reports."""

    capsule_dir: str | None = _ruled(
        None,
        Rule(holds=lambda d: bool(d.strip()), words="a directory path, or None for no capsule"),
    )
    """Where the incident capsule of a run's first NaN/Inf is written (one file: the producer
    module, its inputs and output, or the step's forward inputs and the model, for
    `hookprof replay`), and, with sdc_check_interval_s, the capsule of a replay check that
    did not reproduce; with spike_replay, a spike's and a measured update's that differed or
    jumped (docs/integrity.md). None (the default): none is written. A capsule
    holds a batch of training data: set it only where that data may be kept
    (docs/nonfinite.md)."""

    capsule_max_count: int = _ruled(3, Rule(low=1))
    """At most this many capsules per process (several models, attach after attach)."""

    capsule_max_bytes: int = _ruled(256 * 2**20, Rule(low=0))
    """A capsule holds the model's state_dict when it and the step's inputs fit in this many
    bytes; above it, the inputs and a sha256 of each parameter (a named producer's module is
    saved whatever its size)."""

    incident_steps: int = _ruled(20, Rule(low=0))
    """After a NaN/Inf is seen, sample every step (forward checks on) for up to this many
    steps, until the layer that produced it is found."""

    max_skipped_steps: int = _ruled(10, Rule(low=0))
    """GradScaler skips (fp16 overflow) are normal; more than this many in a row count as a
    non-finite incident (phase "backward")."""

    sdc_check_interval_s: float | None = _ruled(None, Rule(above=0, high=_DAY))
    """Silent data corruption (docs/integrity.md): every this many seconds (up to twice it:
    a power of two of steps, the same steps on every rank), the parameters' fingerprint after
    the update is taken on the device and exported, for Prometheus to compare data-parallel
    replicas, which must hold identical bits (only for replicas: ranks holding shards or
    pipeline stages differ by design); and, in a single-rank process, the step's forward is
    replayed before its update and every layer's output compared bitwise with the step's
    own, naming the first layer that differs. None: off."""

    sdc_replica_group: str = ""
    """The replica check's group within a run (docs/integrity.md): ranks of one run with the
    same parameter names, shapes and dtypes are compared unless they give different groups
    here. Set it where ranks of one run hold different values under the same names and
    shapes: a pipeline stage's index, a tensor-parallel rank's coordinate."""

    spike_detection: bool = True
    """Judge every step's loss and global gradient norm for spikes on the publisher thread
    (issue 43, hookprof/publish/spikes.py): hookprof_spikes_total, HookprofTrainingSpike."""

    spike_replay: bool = False
    """Arm the spike verdict (docs/integrity.md): every step keeps its forward's inputs, RNG
    and modules' state, its output's bit sums and a copy of its parameters before its
    update (their size in memory, copied once per step), so that a step whose loss or
    gradient norm passes the spike gate is replayed after its update and its output compared
    bitwise: reproduced (the data) or not (the machine); with update_norms, each step that
    measures updates runs the turn's update a second time on copies, an update ratio
    jump's verdict (integrity/update_replay.py). A single-rank process only; on a GPU one
    wait per step for the previous step's gate flag. Off by default."""

    spike_window: int = _ruled(200, Rule(low=10, high=100_000))
    """... against this many finite values of the steps before each one."""

    loss_spike_z: float = _ruled(
        8.0, Rule(holds=lambda v: 0 < v < math.inf, words="a finite number > 0")
    )
    """A step's loss is a spike when its robust z-score against the window is above this (and
    it stands 10% of the median above it) ..."""

    grad_norm_spike_z: float = _ruled(
        12.0, Rule(holds=lambda v: 0 < v < math.inf, words="a finite number > 0")
    )
    """... and the global gradient norm when its z-score is above this and it is at least
    twice the window's median."""

    update_ratio_jump_z: float = _ruled(
        12.0, Rule(holds=lambda v: 0 < v < math.inf, words="a finite number > 0")
    )
    """... and a layer's update-to-weight ratio, on the sampled steps that measure it
    (update_norms), when its z-score against that layer's recent ratios is above this and it
    is at least 4x their median (kind update_ratio_jump)."""

    vanishing_grad_norm: float = 1e-6
    """On sampled steps a layer whose gradient norm is below this is flagged "vanishing" ..."""

    exploding_grad_norm: float = _ruled(
        1e3,
        Rule(holds=lambda v: 0 < v < math.inf, words="a finite number > 0"),  # nan too
    )
    """... and above this, "exploding" (hookprof_gradient_flagged_steps_total)."""

    publish_interval_s: float = _ruled(1.0, _THREAD_INTERVAL)
    """How often the background thread republishes step counters between sampled steps."""

    system_metrics: bool = True
    """Export host CPU and memory (psutil), the process's CPU, RSS and open files, and
    PyTorch's CUDA memory, sampled by a background thread every `system_interval_s`."""

    gpu_metrics: bool = True
    """Export per-GPU utilisation, memory, power, temperature and energy from NVML (needs
    nvidia-ml-py: `pip install 'hookprof[gpu]'`). Only local rank 0 exports them, one series
    per GPU per node. Turn off where dcgm-exporter already runs."""

    system_interval_s: float = _ruled(5.0, _THREAD_INTERVAL)
    """How often host, process and GPU statistics are sampled (never per step)."""

    summary_at_exit: bool = True
    """At detach() (and at interpreter exit while still attached) say a short summary: steps,
    step time p50/p95, NaN/Inf counts and the first offender, the five costliest layers. To
    the "hookprof" logger when logging shows INFO, else to stderr."""

    stall_detection: bool = True
    """Watch for stalls (docs/stalls.md): a small daemon thread compares how long the
    training thread has been in its current step phase with that phase's typical duration."""

    stall_factor: float = _ruled(5.0, Rule(low=1, high=1e6))
    """A phase lasting more than this many times its typical duration (the median of its
    share of recent steps) is a stall ..."""

    stall_min_s: float = _ruled(30.0, Rule(above=0, high=7 * _DAY))
    """... but never one shorter than this (phases of a few milliseconds vary by more than
    any factor) ..."""

    stall_max_s: float = _ruled(480.0, Rule(high=7 * _DAY))
    """... and always one longer than this: below the NCCL watchdog's default timeout
    (10 min), so the report comes while the job is still alive."""

    stall_warmup_steps: int = _ruled(3, Rule(low=0))
    """Steps completed before phases are judged (the first compile, cache warm-up)."""
    flop_counting: bool = True
    """Count each layer's forward and backward FLOPs (once per input shape, on meta tensors)
    and export FLOPs per layer, achieved FLOP/s per layer and for the model, and the model's
    FLOPs utilisation when the device's peak is known (docs/efficiency.md)."""

    peak_flops: float | None = _ruled(None, Rule(above=0, high=1e21))  # a zettaFLOP/s per device
    """Peak FLOP/s of one device for the model's precision, for the utilisation ratio. None:
    looked up by GPU name and precision (hookprof/efficiency/peaks.py); unknown GPUs and CPUs get none."""

    update_norms: bool = True
    """On sampled steps, export each layer's weight norm, update norm (the change the
    optimizer step made) and their ratio, and the global update-to-weight ratio."""

    update_norm_max_bytes: int = _ruled(256 * 2**20, Rule(low=0))
    """Most bytes of parameters copied before an update to measure it: beyond it, layers
    take turns across sampled steps (a layer larger than this alone is copied alone)."""

    update_norm_interval_s: float = _ruled(1.0, Rule(low=0, high=_DAY))
    """Update norms are measured on sampled steps at most this often: a measurement copies
    and reads the parameters (~0.6 of a step on a small-batch CPU MLP), so sampling every
    step must not mean copying every step."""

    disable: bool = False
    """Kill switch: attach() returns a profiler that does nothing (HOOKPROF_DISABLE=1)."""

    def __post_init__(self) -> None:
        # one loop: each field's type and rules (beside the field: `_ruled`), then the rules
        # that relate two fields; the first that fails is raised, naming the field to change
        for name, problem in _CHECKS:
            expected = problem(self)
            if expected is not None:
                raise ConfigError(name, getattr(self, name), expected)
        if self.local_rank is not None:
            self.check_local_rank(self.local_rank)

    def check_local_rank(self, local_rank: int, source: str | None = None) -> None:
        """The served port, `port + local_rank`, must be a TCP port (`source`: where
        local_rank came from, e.g. $LOCAL_RANK; None: the config field)."""
        if self.serve and self.port and self.port + local_rank > 65535:
            raise ConfigError(
                "local_rank",
                local_rank,
                f"at most {65535 - self.port}: port {self.port} + local_rank is the served "
                "port, which must be <= 65535",
                source,
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields: Any) -> Config:
        """Defaults, overridden by `HOOKPROF_<FIELD>` variables, overridden by `fields`."""
        values = read_env(os.environ if environ is None else environ)
        check_fields(fields)
        values.update(fields)
        return cls(**values)

    def replace(self, **fields: Any) -> Config:
        check_fields(fields)
        return dataclasses.replace(self, **fields)


_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(Config)
_warned: set[str] = set()  # misspelt variables already warned about

# a host name: dot-separated labels of letters, digits and hyphens (RFC 1123), the last one
# not all digits (so that 999.1.1.1 is a bad IPv4 address, not a host name). No DNS lookup.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"^(?:{_LABEL}\.)*(?!\d+\.?$){_LABEL}\.?$")


def _is_address(addr: str) -> bool:
    """An IPv4 or IPv6 literal, or a host name of valid form (never looked up here)."""
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    return len(addr) <= 253 and _HOST_NAME.match(addr) is not None


def closest_field(name: str, cutoff: float = 0.6) -> str | None:
    """The Config field closest to a misspelt `name` (difflib's ratio >= cutoff), if any."""
    close = difflib.get_close_matches(name.lower(), list(_FIELD_TYPES), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str) -> str:
    field = closest_field(name)
    return f" (did you mean {field!r}?)" if field else ""


def check_fields(fields: Mapping[str, Any]) -> None:
    """A TypeError for a name that is no Config field, with the closest field when one is
    close (a list of all 40-odd fields hides the one meant)."""
    unknown = sorted(set(fields) - set(_FIELD_TYPES))
    if unknown:
        hints = ", ".join(repr(name) + did_you_mean(name) for name in unknown)
        raise TypeError(
            f"unknown hookprof config field(s): {hints}; every field is listed in "
            "docs/configuration.md and help(hookprof.Config)"
        )


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def misspelt_env(environ: Mapping[str, str]) -> list[str]:
    """One line per `HOOKPROF_*` variable that is no setting but close to one (a variable
    far from every setting may be someone else's, e.g. a script's HOOKPROF_ROOT)."""
    lines = []
    for name in sorted(environ):
        if (
            name.startswith(ENV_PREFIX)
            and name.removeprefix(ENV_PREFIX).lower() not in _FIELD_TYPES
        ):
            # closer than for a keyword argument: HOOKPROF_ROOT is no misspelt HOOKPROF_PORT
            field = closest_field(name.removeprefix(ENV_PREFIX), cutoff=0.75)
            if field is not None:
                lines.append(
                    f"{name} is not a hookprof setting and is ignored "
                    f"(did you mean {env_name(field)}?)"
                )
    return lines


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Parse every `HOOKPROF_<FIELD>` present in `environ`; errors name the variable. A
    misspelt one is warned about (misspelt_env), once per variable and process."""
    for line in misspelt_env(environ):
        if line not in _warned:
            _warned.add(line)
            warnings.warn(line, UserWarning, stacklevel=3)
    values: dict[str, Any] = {}
    for field, hint in _FIELD_TYPES.items():
        name = env_name(field)
        if name in environ:
            values[field] = _parse(field, name, environ[name], hint)
    return values


def env_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """The kill switch wins over any config passed in code."""
    environ = os.environ if environ is None else environ
    name = env_name("disable")
    return name in environ and _parse("disable", name, environ[name], bool)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(field: str, source: str, raw: str, hint: Any) -> Any:
    text = raw.strip()
    if typing.get_origin(hint) is Literal:
        return text  # which words are allowed is checked by Config.__post_init__
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if optional and text.lower() in ("", "none"):
        return None
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(field, raw, "one of 1/0/true/false/yes/no/on/off", source)
    try:
        return base(text)
    except ValueError:
        raise ConfigError(field, raw, _WORDS.get(base, base.__name__), source) from None


_WORDS = {int: "an integer", float: "a number", str: "a string"}


def _type_problem(value: Any, hint: Any) -> str | None:
    """None when `value` is of the field's type `hint`; else what it must be."""
    if typing.get_origin(hint) is Literal:
        hint = str  # the words themselves: _field_checks
    allowed = typing.get_args(hint) or (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        if kind is bool and isinstance(value, bool):
            return None
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if kind is str and isinstance(value, str):
            return None
    names = " or ".join("None" if k is type(None) else k.__name__ for k in allowed)
    return f"of type {names}"


# the rules that relate two fields, after every field's own: (the field named, a test of the
# whole config, what that field must be)
_RELATIONS: tuple[tuple[str, Callable[[Config], bool], Callable[[Config], str]], ...] = (
    (
        "tls_keyfile",
        lambda c: c.tls_certfile is None or c.tls_keyfile is not None,
        lambda c: "a PEM file path (set together with tls_certfile)",
    ),
    (
        "tls_certfile",
        lambda c: c.tls_keyfile is None or c.tls_certfile is not None,
        lambda c: "a PEM file path (set together with tls_keyfile)",
    ),
    (
        "tls_certfile",
        lambda c: c.tls_client_cafile is None or c.tls_certfile is not None,
        lambda c: "a PEM file path: tls_client_cafile needs TLS (tls_certfile, tls_keyfile)",
    ),
    (
        "http_max_connections",
        lambda c: c.http_max_connections > c.http_max_requests,
        lambda c: f"above http_max_requests ({c.http_max_requests})",
    ),
    (
        "vanishing_grad_norm",
        lambda c: 0 <= c.vanishing_grad_norm < c.exploding_grad_norm,
        lambda c: ">= 0 and below exploding_grad_norm",
    ),
    (
        "stall_max_s",
        lambda c: c.stall_max_s >= c.stall_min_s,
        lambda c: f">= stall_min_s ({c.stall_min_s})",
    ),
    (
        "spike_replay",
        lambda c: not c.spike_replay or c.spike_detection,
        lambda c: "False while spike_detection is False (it replays the spikes that detects)",
    ),
)


def _field_checks(name: str, hint: Any, rules: tuple[Rule, ...]) -> list[tuple[str, Any]]:
    nullable = type(None) in typing.get_args(hint)
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    checks: list[tuple[str, Any]] = [(name, lambda c: _type_problem(getattr(c, name), hint))]
    if choices:  # the words of a Literal field
        checks.append(
            (name, lambda c: None if getattr(c, name) in choices else f"one of {choices}")
        )
    for rule in rules:
        checks.append((name, lambda c, rule=rule: rule.expected(getattr(c, name), nullable)))
    return checks


def _relation_check(holds: Callable[[Config], bool], words: Callable[[Config], str]) -> Any:
    return lambda c: None if holds(c) else words(c)


# every check Config.__post_init__ runs, in order: (field, config -> what it must be, or None)
_CHECKS: tuple[tuple[str, Callable[[Config], str | None]], ...] = tuple(
    [
        check
        for f in dataclasses.fields(Config)
        for check in _field_checks(f.name, _FIELD_TYPES[f.name], f.metadata.get("rules", ()))
    ]
    + [(name, _relation_check(holds, words)) for name, holds, words in _RELATIONS]
)
