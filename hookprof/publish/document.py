"""The run report's document: one model's history and per-layer totals, and its JSON form,
the one /history.json serves (a NaN there means "no value"; an infinity is written as a
string, since JSON has neither).

Built on the publisher's side (the history is held there); the endpoint serves it and
view/report.py reads it back from a URL. The same document feeds `prof.report("run.html")`
and `hookprof report URL -o run.html`, so the page looks the same whichever way it was made
(view/report_html.py draws it)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from hookprof._version import __version__
from hookprof.nonfinite.incident import describe
from hookprof.publish.history import History, stored
from hookprof.snapshot import Snapshot

NONFINITE = "NaN/Inf"  # how a non-finite number is written in the JSON (JSON has none)


def document(
    name: str, snapshot: Snapshot, history: History, recent: int | None = None
) -> dict[str, Any]:
    """One model's report: the history's series and the snapshot's per-layer totals (mean
    forward and backward seconds per sampled step, for the layers the exporter shows). With
    `recent`, only who it is and its last `recent` steps' loss and gradient norm (what
    `hookprof top` reads every second: /history.json?recent, a few KB, not the whole)."""
    if recent is not None:
        return {
            "model": name,
            "rank": snapshot.rank,
            "steps": snapshot.step,
            "recent": history.every_step.tail(recent),
            "lead_up": history.every_step.tail(recent, lead_up=True),
        }
    sampled = max(snapshot.sampled_steps, 1)
    layers = []
    for layer_name in snapshot.exported_layers + snapshot.timed_layers:
        stats = snapshot.layers[layer_name]
        layers.append(
            {
                "name": layer_name,
                "module": stats.module,
                "forward_seconds": stats.forward_seconds_total / sampled,
                "backward_seconds": stats.backward_seconds_total / sampled,
                "grad_norm": stats.grad_norm,
                "nonfinite": dict(stats.nonfinite),
                # what the per-layer table needs to show the figures `hookprof top` shows
                "forward_seconds_total": stats.forward_seconds_total,
                "forward_calls": stats.forward_calls_total,
                "backward_seconds_total": stats.backward_seconds_total,
                "backward_calls": stats.backward_calls_total,
                "activation_abs_max": stats.activation_abs_max,
                "activation_zero_ratio": stats.activation_zero_ratio,
            }
        )
    first = snapshot.first_nonfinite
    return {
        "model": name,
        "rank": snapshot.rank,
        "hookprof_version": __version__,
        "generated_at": time.time(),
        "steps": snapshot.step,
        "sampled_steps": snapshot.sampled_steps,
        "sampled_step_seconds_sum": snapshot.sampled_step_seconds,
        "step_seconds_mean": snapshot.step_duration_sum / snapshot.step if snapshot.step else None,
        "step_seconds_sum": snapshot.step_duration_sum,
        "held_back_updates": snapshot.held_back_updates,
        "loss": stored(snapshot.loss),
        "grad_norm": stored(snapshot.grad_norm),
        "spikes": {
            kind: {
                "count": count.count,
                "first": _spike(count.first),
                "last": _spike(count.last),
            }
            for kind, count in snapshot.spikes.items()
        },
        "replay_checks": dict(snapshot.replay_checks),
        "spike_replays": dict(snapshot.spike_replays),
        "replay_mismatch": None
        if snapshot.replay_mismatch is None
        else dataclasses.asdict(snapshot.replay_mismatch),
        "spike_mismatch": None
        if snapshot.spike_mismatch is None
        else dataclasses.asdict(snapshot.spike_mismatch),
        "nonfinite_steps": dict(snapshot.nonfinite_steps),
        "skipped_steps": snapshot.skipped_steps,
        "dropped_nonfinite": None
        if snapshot.dropped_nonfinite is None
        else dataclasses.asdict(snapshot.dropped_nonfinite),
        "first_nonfinite": None
        if first is None
        else {**dataclasses.asdict(first), "summary": describe(first, snapshot.rank)},
        "layers_total": len(snapshot.layers),
        "layer_totals": layers,
        "history": history.view(),
    }


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if value != value else NONFINITE  # NaN only ever means "no value" here
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if value == NONFINITE:
        return math.inf
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def to_json(documents: list[dict[str, Any]]) -> bytes:
    """What /history.json serves: {"models": [document, ...]}, strict JSON."""
    return json.dumps(
        {"models": _encode(documents)}, allow_nan=False, separators=(",", ":")
    ).encode()


def from_json(body: bytes) -> list[dict[str, Any]]:
    return _decode(json.loads(body)["models"])


def _spike(event: Any) -> dict[str, Any] | None:
    """A spike event (snapshot.SpikeEvent) as the document keeps it (an update ratio jump's
    with its layer)."""
    if event is None:
        return None
    kept = {"step": event.step, "value": event.value, "median": event.median, "z": event.z}
    if event.verdict is not None:  # (its step's replay: Config.spike_replay)
        kept["verdict"] = event.verdict
    if event.capsule is not None:
        kept["capsule"] = event.capsule
    if event.entered is not None:  # (a not-reproduced replay's first differing layer)
        kept["entered"] = event.entered
        kept["entered_phase"] = event.entered_phase
    if event.suspects is not None:  # (its batch's samples of largest loss)
        kept["suspects"] = [{"sample": s.sample, "loss": s.loss} for s in event.suspects]
    return kept if event.layer is None else {**kept, "layer": event.layer}
