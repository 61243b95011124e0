"""What happens when a NaN/Inf is seen: the on_nonfinite policies."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

from .config import Config
from .errors import NonFiniteError
from .health import log
from .snapshot import NonFiniteEvent, Snapshot


def describe(event: NonFiniteEvent, rank: int) -> str:
    where = f"layer {event.layer}" if event.layer else "a layer not yet localised"
    text = f"NaN/Inf in the {event.phase} phase at step {event.step} on rank {rank}, first in {where}"
    if event.propagators:
        text += f" (then {', '.join(event.propagators[:5])}{' ...' if len(event.propagators) > 5 else ''})"
    return text


def apply(policy: str, event: NonFiniteEvent, snap: Snapshot, config: Config, rank: int) -> str | None:
    """Act on the first incident of a run. Returns the report's path under "dump"."""
    if policy == "warn":
        log.warning("hookprof: %s", describe(event, rank))
    elif policy == "raise":
        raise NonFiniteError(event.layer, event.phase, event.step, rank)
    elif policy == "dump":
        path = write_report(event, snap, config.dump_dir, rank)
        log.warning("hookprof: %s; report written to %s", describe(event, rank), path)
        return path
    return None


def _plain(value: Any) -> Any:
    """JSON has no NaN/Inf: they are written as strings, which is what a report is about."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_report(event: NonFiniteEvent, snap: Snapshot, directory: str, rank: int) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"hookprof-nonfinite-rank{rank}-step{event.step}.json")
    report = {
        "summary": describe(event, rank),
        "rank": rank,
        "written_at": time.time(),
        "incident": dataclasses.asdict(event),
        "step": snap.step,
        "nonfinite_steps": dict(snap.nonfinite_steps),
        "loss": snap.loss,
        "grad_norm": snap.grad_norm,
        "layers": {name: {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
                   for name, stats in snap.layers.items()},
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_plain(report), f, indent=2)
    os.replace(tmp, path)
    return path
