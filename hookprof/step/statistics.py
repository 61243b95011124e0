"""Per-layer statistics of sampled steps, as parts a user (or a new feature) writes alone.

A statistic is one small object: a name, a help text, and `reduce(output)`, which turns a
layer's output tensor into one 0-d tensor on the same device (a traceable tensor op: no
`.item()`, no Python branch on a value, so it never makes the host wait). hookprof calls it
on every floating output of every instrumented layer call of a sampled step with activation
statistics (the steps that take `hookprof_layer_activation_abs_max`), carries the results in
the step's one device-to-host copy, and exports the value of the layer's last call as the
gauge `hookprof_layer_<name>{rank, layer}`:

    class OutputMean:
        name = "activation_mean"
        help = "Mean of the layer's output at the last sampled step"

        def reduce(self, output: torch.Tensor) -> torch.Tensor:
            return output.float().mean()

    prof = hookprof.attach(model, layer_statistics=(OutputMean(),))

Nothing else is written: no change to the profiler, the record, the publisher or the
exporter (docs/architecture.md, "Adding to it").

A statistic of a layer's **parameters** says so with `source = "parameters"`; its `reduce`
gets the layer's own parameters (a tuple of detached tensors, in `named_parameters` order; of a
DTensor parameter, FSDP2's or tensor parallel's, this rank's local shard, so the value is the
rank's, as the gradient norms are) at each sampled step's end, after the update, for every
layer that owns parameters:

    class WeightRMS:
        name = "weight_rms"
        help = "Root mean square of the layer's parameters after the last sampled update"
        source = "parameters"

        def reduce(self, parameters: tuple[torch.Tensor, ...]) -> torch.Tensor:
            squares = sum(p.float().pow(2).sum() for p in parameters)
            return (squares / sum(p.numel() for p in parameters)).sqrt()

(hookprof's own `hookprof_layer_weight_norm` is a figure of the parameters too, of source
"update": every layer's parameters around a measured update in one pass over all layers,
`reduce_layers(view)`, step/update_statistics.py.)

Two optional methods and a third source say more, for a statistic that needs them;
hookprof's own activation statistics (step/builtin_statistics.py:
`hookprof_layer_activation_abs_max` and `hookprof_layer_activation_zero_ratio`) are written
with them, as parts of this interface:

- `reduce` may return a tuple of values (0-d tensors on the device, or plain numbers known on
  the host), and `fold(calls)` turns them into the exported value on the publisher's thread:
  `calls` lists the tuples of each of the layer's calls in the step (a layer called several
  times per step: a shared block, an RNN cell), as floats, in call order. Without `fold` the
  value is the last call's first value. A ratio over the step's calls is a tuple
  (part, whole) per call and a `fold` that sums both.
- `applies_to(module) -> bool` is asked once per layer at attach: False and the statistic
  never reduces that layer (the zero ratio: layers without parameters of their own).
- `source = "extremes"`: no `reduce` at all; `fold(calls)` gets the (min, max) of each of
  the layer's outputs in the step, the values hookprof's non-finite check takes of every
  output anyway (one `aminmax`, already in the step's copy): a statistic of them costs no
  device work and no work in the hooks. The abs max is such a statistic, folded as the
  largest of -min and max.

Owns: the protocol and the checks of a statistic, and the taking of the parameter ones
(`ParameterStatistics`; those of the update: step/update_statistics.py). Used by:
`Profiler` (`checked`, at attach), `LayerHooks` (reduce of the output ones), `StepEvents`
(the parameter ones, at a sampled step's end), `pack_step` (stacking), `Aggregator`
(folding, and the last values) and `SnapshotCollector` (the gauge).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from hookprof.errors import ConfigError
from hookprof.metrics_names import BY_NAME, LAYER_STATISTIC_PREFIX

NAME = re.compile(r"[a-z][a-z0-9_]*")

# what a statistic reduces: each instrumented output of a layer (the default), the layer's
# own parameters at a sampled step's end, the (min, max) the non-finite check took of each
# output (folded on the publisher's thread: no reduce), or every layer's parameters around
# a measured update, all layers in one pass (`reduce_layers`)
OUTPUT, PARAMETERS, EXTREMES, UPDATE = "output", "parameters", "extremes", "update"
SOURCES = (OUTPUT, PARAMETERS, EXTREMES, UPDATE)
# the method each source's statistic must have
_NEEDS = {OUTPUT: "reduce", PARAMETERS: "reduce", EXTREMES: "fold", UPDATE: "reduce_layers"}


def source_of(statistic: Any) -> str:
    """What `statistic` reduces: its `source`, OUTPUT when it has none."""
    return getattr(statistic, "source", OUTPUT)


@runtime_checkable
class LayerStatistic(Protocol):
    """One per-layer statistic of sampled steps (see the module's docstring)."""

    name: str  # exported as hookprof_layer_<name>: lowercase, digits, underscores
    help: str  # the metric's HELP text
    # (optional) source: "output" (the default), "parameters" or "extremes" (see the module's
    # docstring; an "extremes" one has fold and no reduce, so it is not this Protocol's)
    # (optional) fold(calls) -> float | None, applies_to(module) -> bool (the same)

    def reduce(self, output: Any) -> Any:
        """A 0-d tensor on the device of what it reads (an output tensor, or a layer's
        parameters), or a tuple of such values and host numbers; never waits for the device."""
        ...


def checked(statistics: Any, *, own: bool = False) -> tuple[LayerStatistic, ...]:
    """`statistics` if it is a tuple (or list) of well-formed statistics with names of their
    own; else ConfigError naming `layer_statistics` and what is wrong. `own`: hookprof's
    built-in ones, whose names are its own metrics' (metrics_names.py) rather than never."""
    if isinstance(statistics, list):
        statistics = tuple(statistics)
    if not isinstance(statistics, tuple):
        raise ConfigError("layer_statistics", statistics, "a tuple of layer statistics")
    seen: set[str] = set()
    for stat in statistics:
        needs = _NEEDS.get(source_of(stat), "reduce")  # (an unknown source: refused below)
        if not (hasattr(stat, "name") and hasattr(stat, "help")) or not callable(
            getattr(stat, needs, None)
        ):
            raise ConfigError(
                "layer_statistics",
                stat,
                "objects with name, help and reduce(output) (of source 'extremes': fold; of "
                "source 'update': reduce_layers)",
            )
        if not isinstance(stat.name, str) or not NAME.fullmatch(stat.name):
            raise ConfigError(
                "layer_statistics", stat.name, "names of lowercase letters, digits and underscores"
            )
        if (LAYER_STATISTIC_PREFIX + stat.name in BY_NAME) != own or stat.name in seen:
            raise ConfigError(
                "layer_statistics",
                stat.name,
                "a name neither given twice nor one of hookprof's own metrics"
                if not own
                else "a built-in statistic's name among hookprof's metrics (metrics_names.py)",
            )
        if not isinstance(stat.help, str) or not stat.help.strip():
            raise ConfigError("layer_statistics", stat.help, f"a help text for {stat.name!r}")
        if source_of(stat) not in SOURCES:
            raise ConfigError(
                "layer_statistics",
                source_of(stat),
                f"a source of {stat.name!r} among {', '.join(map(repr, SOURCES))}",
            )
        for method in ("fold", "applies_to", "reduce_layers"):
            if not callable(getattr(stat, method, callable)):
                raise ConfigError(
                    "layer_statistics",
                    getattr(stat, method),
                    f"{stat.name!r}'s {method} as a method (or none)",
                )
        seen.add(stat.name)
    return statistics


def applies(statistic: Any, module: Any, report: Any = None) -> bool:
    """Whether `statistic` reduces the layer `module` (its `applies_to`; yes without one).
    One that raises is reported to `report(part, exc)` and reduces nothing there."""
    applies_to = getattr(statistic, "applies_to", None)
    if applies_to is None:
        return True
    try:
        return bool(applies_to(module))
    except Exception as exc:
        if report is not None:
            report(f"layer statistic {statistic.name}", exc)
        return False


# what a statistic's tensors may hold: what one float64 stack takes exactly or as a float
# does (not complex, float8 or quantized values, which a stack refuses: a step's whole copy
# would fail in pack_step)
SENDABLE = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def values_of(statistic: Any, result: Any) -> tuple[Any, ...]:
    """`result`, what a statistic's reduce returned, as the tuple of values that is sent:
    one-value real tensors on one device (detached, 0-d, stacked with the step's others into
    its one copy) and host numbers (as floats); TypeError (or OverflowError) naming the
    statistic otherwise, raised here, where the caller contains it. Runs for every output of
    every layer of a sampled step, so the usual case (plain tensors) takes the fewest
    checks: a DTensor is a subclass, a device is compared only when a result holds a second
    tensor."""
    values = (result,) if not isinstance(result, tuple) else result
    if not values:
        raise TypeError(f"layer statistic {statistic.name!r}: reduce() returned no value")
    out: list[Any] = []
    device = None
    for value in values:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and hasattr(value, "to_local"):
                raise TypeError(  # a DTensor: it cannot ride the step's copy of plain ones
                    f"layer statistic {statistic.name!r}: reduce() returned a DTensor; reduce "
                    "this rank's local tensor (dtensor.to_local()) and return a plain one"
                )
            if value.numel() != 1 or value.dtype not in SENDABLE:
                raise TypeError(
                    f"layer statistic {statistic.name!r}: reduce() must return one-value "
                    f"real tensors (float, integer or bool), got one of shape "
                    f"{tuple(value.shape)} and {value.dtype}"
                )
            if device is None:
                if value.is_meta:  # (no data to copy; a later one on another device: below)
                    raise TypeError(
                        f"layer statistic {statistic.name!r}: reduce() returned a tensor on "
                        "the meta device, which holds no value"
                    )
                device = value
            elif value.device != device.device:
                raise TypeError(
                    f"layer statistic {statistic.name!r}: reduce() returned tensors on "
                    "several devices; return them on one"
                )
            if value.requires_grad:
                value = value.detach()
            if value.dim():
                value = value.reshape(())
        elif isinstance(value, (int, float)):
            value = float(value)  # (OverflowError for an int beyond a float: contained here)
        else:
            raise TypeError(
                f"layer statistic {statistic.name!r}: reduce() must return one-value "
                f"tensors or numbers, got {type(value).__qualname__}"
            )
        out.append(value)
    return tuple(out)


def fold_calls(statistic: Any, calls: list[tuple[float, ...]]) -> float | None:
    """A layer's value of `statistic` from its calls' values in one step (its `fold`; the
    last call's first value without one)."""
    fold = getattr(statistic, "fold", None)
    if fold is None:
        return calls[-1][0]
    value = fold(calls)
    return None if value is None else float(value)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a statistic reads it: detached, and a DTensor's (FSDP2, tensor
    parallel) local shard, so that its value is this rank's, as the gradient norms are."""
    param = param.detach()
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


def of_parameters(
    statistics: Sequence[Any],
    source: str,
    layers: Sequence[tuple[int, Any, Sequence[Any]]],
    report: Any = None,
) -> list[tuple[int, Any, list[tuple[int, tuple[Any, ...]]]]]:
    """The statistics of `source` (PARAMETERS, UPDATE), each with its index and the layers it
    reduces (those that own parameters and that it applies to: index, own parameters).
    `statistics`: all of a profiler's (their position is their index everywhere); `layers`:
    (layer index, its module, its own parameters) of each layer; `report(part, exc)` hears of
    an `applies_to` that raised."""
    owning = [(index, module, tuple(params)) for index, module, params in layers if params]
    return [
        (k, s, [(i, params) for i, module, params in owning if applies(s, module, report)])
        for k, s in enumerate(statistics)
        if source_of(s) == source
    ]


class ParameterStatistics:
    """The statistics whose source is a layer's parameters (`source = "parameters"`), taken
    at each sampled step's end, after the update: `take()` reduces every layer that owns
    parameters (and that it applies to) and returns (statistic, layer, its values: 0-d
    tensors on the device and host numbers) to be sent with the step. A statistic that fails
    is reported and skipped for the rest of that step; the others, and every other figure,
    go on."""

    def __init__(
        self,
        statistics: Sequence[Any],
        layers: Sequence[tuple[int, Any, Sequence[Any]]],
        report: Any = None,
    ):
        """(See `of_parameters`.)"""
        self._statistics = of_parameters(statistics, PARAMETERS, layers, report)

    def __bool__(self) -> bool:
        return bool(self._statistics)

    def take(self, report: Any) -> list[tuple[int, int, tuple[Any, ...]]]:
        """This step's values; `report(part, exc)` hears of a statistic that failed."""
        taken: list[tuple[int, int, tuple[Any, ...]]] = []
        for k, stat, layers in self._statistics:
            try:
                values = [
                    (k, index, values_of(stat, stat.reduce(tuple(map(_local, params)))))
                    for index, params in layers
                ]
            except Exception as exc:
                report(f"layer statistic {stat.name}", exc)
                continue
            taken.extend(values)
        return taken
