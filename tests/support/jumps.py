"""The tests' own judge of update ratio jumps (tests/behaviour/test_spikes.py,
test_update_capsule.py): each layer's ratio computed from the test's own copies around the
update, and the jump rule as docs/nonfinite.md gives it, written here with numpy and plain
lists (not hookprof's sorted windows or its event code)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


def layer_ratios(layers: dict[str, nn.Module], before: dict[str, list[torch.Tensor]]):
    """Each layer's ||after - before|| / ||after|| over its parameters, in float64."""
    return {
        n: math.sqrt(
            sum(
                float((p.detach() - b).double().square().sum())
                for p, b in zip(m.parameters(), before[n])
            )
            / sum(float(p.detach().double().square().sum()) for p in m.parameters())
        )
        for n, m in layers.items()
    }


def update_ratio_jumps(ratios: list[dict[str, float]], threshold: float = 12.0):
    """(first step, layer) of each update ratio jump event, by the rule docs/nonfinite.md
    gives: each layer against its own last 64 finite nonzero ratios, from 20 of them on, 4x
    the median; one event per step, the layer of the highest z named; an event lasts while
    its layers stay above half the threshold and margin when judged, a layer's part of it
    ending once it has appeared with no ratio kept (0, NaN) more than 3 times its longest
    run of such appearances among its last 8 (at least 1, at most 64), or not appeared for
    more than 8 times the median of its last 8 gaps between appearances. Each entry of
    `ratios` is one measurement of the model; the layers in it are those that appear."""
    seen: dict[str, list[float]] = {}
    appeared: dict[str, int] = {}
    gaps: dict[str, list[int]] = {}
    unkept: dict[str, int] = {}
    runs: dict[str, list[int]] = {}
    inside: set[str] = set()
    events = []

    def overdue(layer: str, step: int) -> bool:
        if unkept.get(layer, 0) > 3 * min(max(runs.get(layer, [])[-8:], default=1), 64):
            return True
        recent = sorted(gaps.get(layer, [])[-8:])
        return step - appeared[layer] > 8 * (recent[len(recent) // 2] if recent else 1)

    for step, by_layer in enumerate(ratios, 1):
        inside = {layer for layer in inside if not overdue(layer, step)}
        in_event = bool(inside)
        worst = None
        for layer, x in by_layer.items():
            if layer in appeared:
                gaps.setdefault(layer, []).append(step - appeared[layer])
            appeared[layer] = step
            if not math.isfinite(x) or x == 0:
                unkept[layer] = unkept.get(layer, 0) + 1
                continue  # no update at all, or the NaN checks': neither judged nor kept
            if unkept.get(layer):
                runs.setdefault(layer, []).append(unkept.pop(layer))
            history = seen.setdefault(layer, [])
            if len(history) >= 20:
                w = np.array(history[-64:])
                median = float(np.median(w))
                scale = float(np.percentile(w, 75) - np.percentile(w, 25)) / 1.349
                z = (x - median) / scale if scale else (math.inf if x > median else 0.0)
                margin = 3.0 * max(abs(median), scale)
                spike = z > threshold and x > median + margin
                going = z > threshold / 2 and x > median + margin / 2
                if spike or (going and layer in inside):
                    inside.add(layer)
                else:
                    inside.discard(layer)
                if spike and (worst is None or z > worst[1]):
                    worst = (layer, z)
            history.append(x)
        if worst is not None and not in_event:
            events.append((step, worst[0]))
    return events
