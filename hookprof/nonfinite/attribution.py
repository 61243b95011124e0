"""Who made the first NaN/Inf of the run: the one owner of that answer.

Owns: the run's first non-finite event (its step and phase from the device counters, exact
on every step; its layer once something names it), and the replayed forward's finding
kept for it. Decides from what the publisher folds: the counters as last drained, the
findings of sampled and replayed forwards (`forward_roles`: which call had finite inputs and
a non-finite output), and which layers went bad first in the backward.

Called by: `Aggregator` on the publisher thread (`forward_roles` while reading a record,
`replayed` for a replay's finding, `update` after each fold). Read by: the snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hookprof.layers import INPUT_NAME
from hookprof.nonfinite.detector import PHASE_INDEX
from hookprof.snapshot import NonFiniteEvent
from hookprof.step.record import ROOT_INPUT, StepRecord

LOSS_LAYER = "(loss)"  # layer label of an incident seen in the loss alone


@dataclass(slots=True)
class ForwardFinding:
    # innermost calls first: "(input)" when the root's inputs were non-finite, then layers
    # or container modules with finite inputs and a non-finite output
    producers: list[str]
    propagators: list[str]  # layers with non-finite inputs and outputs, in call order
    bwd_start_of_layer: dict[int, float]
    last_finite_child: str | None = None  # of producers[0], when it is a container



def _with_ancestors(rec: StepRecord, calls: list[int]) -> set[int]:
    """`calls` and every call enclosing one of them (Call.parent, -1 at the top)."""
    out: set[int] = set()
    for c in calls:
        while c >= 0 and c not in out:
            out.add(c)
            c = rec.calls[c].parent
    return out



def forward_roles(rec: StepRecord, names: list[str], n_layers: int, act_max: dict[int, float],
                  bwd_start: dict[int, float], weights_bad: set[int] = frozenset()) -> ForwardFinding:
    """Who made a NaN/Inf on a checked or replayed step: the root's inputs ("(input)"),
    else the innermost call with finite inputs and a non-finite output (the first to end:
    a layer, or a container module whose own code made it); the layers it then flowed
    through (non-finite inputs and output); plus the backward order."""
    out_bad: set[int] = set()
    root_input_bad = False
    for i, act in enumerate(rec.act):
        if not math.isfinite(act_max[i]):
            if act.call >= 0:
                out_bad.add(act.call)
            elif act.call == ROOT_INPUT:
                root_input_bad = True
    in_bad = {call for call, i in rec.inputs if not math.isfinite(act_max[i])}
    n = n_layers  # calls past the layers are container modules (hooked by the replay only)
    # ordered sets: a module called twice is named once. "(input)" only when no module
    # made one from finite inputs: a root input may hold -inf on purpose (an additive
    # attention mask) while a layer is what went wrong
    made = [c for c in rec.ended if c in out_bad and c not in in_bad]
    if weights_bad:  # a layer whose own weights made it is no origin, nor its enclosing calls
        made = [c for c in made if c not in _with_ancestors(rec, [
            m for m in made if rec.calls[m].layer in weights_bad])]
    producers: dict[str, None] = dict.fromkeys(names[rec.calls[c].layer] for c in made)
    if root_input_bad and not producers:
        producers[INPUT_NAME] = None
    propagators = dict.fromkeys(names[rec.calls[c].layer] for c in sorted(out_bad)
                                if c in in_bad and rec.calls[c].layer < n)
    last_finite_child = None
    if made and rec.calls[made[0]].layer >= n:
        children = [c for c in rec.ended if rec.calls[c].parent == made[0] and c not in out_bad]
        last_finite_child = names[rec.calls[children[-1]].layer] if children else None
    start_of_layer: dict[int, float] = {}
    for call, t in bwd_start.items():
        layer = rec.calls[call].layer
        start_of_layer[layer] = min(start_of_layer.get(layer, math.inf), t)
    return ForwardFinding(list(producers), [p for p in propagators if p not in producers],
                          start_of_layer, last_finite_child)


class Attribution:
    """The first NaN/Inf of one model's run (publisher thread only)."""

    def __init__(self, names: list[str]):
        self._names = names
        self.event: NonFiniteEvent | None = None
        self._replayed: tuple[int, ForwardFinding] | None = None  # the replay's finding

    def replayed(self, step: int, finding: ForwardFinding) -> None:
        """The forward of `step` was replayed with the per-layer checks on."""
        self._replayed = (step, finding)

    def update(self, step: int, counters: dict[str, list[int]], forward: ForwardFinding | None) -> None:
        """Keep the first NaN/Inf of the run: its step and phase from the device counters
        (exact, every step), its layer once known."""
        event = self.event
        if event is not None and event.layer is not None:
            return
        c = counters
        firsts = [(c["phase_first"][PHASE_INDEX[p]], order, p)
                  for order, p in enumerate(("forward", "loss", "backward"))
                  if c["phase_first"][PHASE_INDEX[p]] >= 0]
        if not firsts:
            return
        first_step, _, phase = min(firsts)
        layer, propagators, last_finite_child = None, (), None
        if phase == "forward":
            seen = [(step, forward)] if forward is not None else []
            if self._replayed is not None:
                seen.append(self._replayed)  # the incident step's own forward, replayed
            for at, finding in sorted(seen, key=lambda sf: sf[0] != first_step):
                poisoned = 0 <= c["phase_first"][PHASE_INDEX["backward"]] < at
                # a producer seen on a later step counts only if no non-finite gradient
                # was applied in between: after that, every layer's parameters are suspect
                if finding.producers and (at == first_step or not poisoned):
                    layer, propagators = finding.producers[0], tuple(finding.propagators)
                    last_finite_child = finding.last_finite_child
                    break
        elif phase == "loss":
            layer = LOSS_LAYER
        else:
            bad = [i for i, s in enumerate(c["layer_first"]) if s == first_step]
            if bad:
                # the first to go bad in backward: earliest backward start when it was timed
                # on this step, else the last layer in module order (backward runs roughly
                # in reverse)
                starts = forward.bwd_start_of_layer if forward is not None and step == first_step else {}
                first = min(bad, key=lambda i: (starts.get(i, math.inf), -i))
                layer = self._names[first]
                propagators = tuple(self._names[i] for i in bad if i != first)
        self.event = NonFiniteEvent(layer, phase, first_step, propagators, last_finite_child)
