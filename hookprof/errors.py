"""Exceptions hookprof raises to its callers. Each carries the data it talks about."""

from __future__ import annotations

import errno
from typing import Any


class HookprofError(Exception):
    """Base class of every error hookprof raises on purpose."""


class ConfigError(HookprofError, ValueError):
    """A configuration value is out of range or of the wrong type.

    `field` is the Config field, `value` what was received, `source` where it came from
    (an argument, or the environment variable that held it).
    """

    def __init__(self, field: str, value: Any, expected: str, source: str | None = None):
        self.field = field
        self.value = value
        self.expected = expected
        self.source = source or field
        super().__init__(f"{self.source} must be {expected}, got {value!r}")


class AlreadyAttachedError(HookprofError, RuntimeError):
    """The model (or a module inside it) already has a live profiler."""

    def __init__(self, profiler: Any):
        self.profiler = profiler
        super().__init__(
            f"this model is already profiled by {profiler!r}; call .detach() on it first "
            "(or keep using it)"
        )


class MetaDeviceError(HookprofError, ValueError):
    """attach() on a model whose parameters are on the meta device (deferred initialisation):
    they hold no data, and the tensors `to_empty()` makes later are new objects that the
    hooks attached now would never see. `names` are those parameters."""

    def __init__(self, model_type: str, names: list[str]):
        self.model_type = model_type
        self.names = names
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        super().__init__(
            f"{model_type} has parameters on the meta device ({shown}): they hold no data yet. "
            "Attach after materialising the model: model.to_empty(device=...), initialise its "
            "weights, then hookprof.attach(model)"
        )


class PortInUseError(HookprofError, OSError):
    """The metrics port could not be bound."""

    def __init__(
        self, addr: str, port: int, cause: OSError | None = None, *, holder: str | None = None
    ):
        self.addr = addr
        self.port = port
        self.holder = holder  # the model class of the hookprof profiler that serves it, if one does
        if holder is not None:
            why = (
                f"an earlier hookprof profiler in this process serves it, attached to {holder}; "
                "release it with that profiler's detach() or hookprof.detach_all() (for a "
                "notebook cell run again), or choose another"
            )
        else:
            why = f"{cause.strerror or cause if cause is not None else 'in use'}. Choose another"
        super().__init__(
            cause.errno if cause is not None else errno.EADDRINUSE,
            f"cannot serve metrics on {addr}:{port}: {why} port with hookprof.attach(model, "
            "port=...) or HOOKPROF_PORT (port=0 picks a free one)",
        )


class DetachedError(HookprofError, RuntimeError):
    """A method that needs a live profiler was called after detach()."""


class NonFiniteError(HookprofError, FloatingPointError):
    """Raised at a step boundary under on_nonfinite="raise": the first NaN/Inf of the run.

    `layer` is None when no layer could be named (`replay` then says why: "transient" or
    "not replayed"); `phase` is "forward", "backward" or "loss"; `found_by` says how the layer
    was found; the message is the log line's (nonfinite/incident.py, describe)."""

    def __init__(
        self,
        layer: str | None,
        phase: str,
        step: int,
        rank: int,
        *,
        found_by: str | None = None,
        replay: str | None = None,
        message: str | None = None,
    ):
        self.layer = layer
        self.phase = phase
        self.step = step
        self.rank = rank
        self.found_by = found_by  # how the layer was found (NonFiniteEvent.found_by)
        self.replay = replay  # "reproducible", "transient", "not replayed" or None
        where = f"layer {layer}" if layer else "an unlocalised layer"
        super().__init__(
            message
            or f"NaN/Inf in the {phase} phase at step {step} on rank {rank}, first in {where}"
        )
