"""Who made the first NaN/Inf of the run: the one owner of that answer.

Owns: what has been observed of the run's NaN/Inf (the device counters, merged so that a
drain folded late never takes information back; the findings of sampled and replayed
forwards, kept per step; the steps that could not be replayed, and why) and the first
event decided from it. The event is a function of what was observed, never of the order in
which records, replays and counter drains reach the publisher (DESIGN.md invariant 9):
every fold recomputes it from everything kept.

Evidence, strongest first, for a NaN that first appeared in the forward of step `first`:

1. a forward of `first` whose per-layer checks saw the call with finite inputs and a
   non-finite output: on the sampled step itself ("sampled step"), else on its replay
   ("replay"); "(input)" when the batch already held it ("input");
2. the replay of `first` finding a layer whose own weights were non-finite although no
   non-finite update had been applied before it: those weights are the cause ("non-finite
   weights"). Weights that went bad through a non-finite update are no evidence;
3. the same on a later step, while no non-finite gradient was applied in between.

The replay of `first` also says whether the NaN is *reproducible* (it made one again) or
*transient* (with the same inputs, weights and RNG it was finite); a step that could not be
replayed is *not replayed*, with the reason the training thread sent.

Called by: `Aggregator` on the publisher thread (`forward_roles` while reading a record,
then `counters`, `sampled`, `replayed`, `not_replayed` and `decide` at each fold). Read by:
the snapshot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from hookprof.layers import INPUT_NAME
from hookprof.nonfinite.detector import PHASE_INDEX
from hookprof.nonfinite.replay import LATER_WEIGHTS
from hookprof.snapshot import (
    FoundBy,
    NonFiniteEvent,
    ReplayOutcome,
)
from hookprof.step.record import ROOT_INPUT, StepRecord

LOSS_LAYER = "(loss)"  # layer label of an incident seen in the loss alone
# sampled steps whose forward (or backward) saw a NaN/Inf, kept until the counters say which
# step was first; past this many the latest go first: the first bad step is the earliest
KEPT_FINDINGS = 64
WEIGHTS_UNPROVEN = (
    "the replay made it again in a layer whose weights were already non-finite; with "
    "nonfinite_check='loss' the gradients of unsampled steps are not checked, so whether "
    "an earlier update made those weights so is unknown and no layer is named"
)


@dataclass(slots=True)
class ForwardFinding:
    # innermost calls first: "(input)" when the root's inputs were non-finite, then layers
    # or container modules with finite inputs and a non-finite output
    producers: list[str]
    propagators: list[str]  # layers with non-finite inputs and outputs, in call order
    bwd_start_of_layer: dict[int, float]
    last_finite_child: str | None = None  # of producers[0], when it is a container
    # layers with finite inputs and a non-finite output whose own weights were non-finite at
    # the time (a replay's record only): not in `producers`, the weights may be the cause
    weight_producers: list[str] = field(default_factory=list)
    saw_nonfinite: bool = False  # an output of a call of the forward was non-finite


def _with_ancestors(rec: StepRecord, calls: list[int]) -> set[int]:
    """`calls` and every call enclosing one of them (Call.parent, -1 at the top)."""
    out: set[int] = set()
    for c in calls:
        while c >= 0 and c not in out:
            out.add(c)
            c = rec.calls[c].parent
    return out


def forward_roles(
    rec: StepRecord,
    names: list[str],
    n_layers: int,
    act_max: dict[int, float],
    bwd_start: dict[int, float],
    weights_bad: AbstractSet[int] = frozenset(),
) -> ForwardFinding:
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
    weight_made = [m for m in made if rec.calls[m].layer in weights_bad]
    if (
        weight_made
    ):  # a layer whose own weights made it is no proven origin, nor its enclosing calls
        made = [c for c in made if c not in _with_ancestors(rec, weight_made)]
    producers: dict[str, None] = dict.fromkeys(names[rec.calls[c].layer] for c in made)
    if root_input_bad and not producers and out_bad:
        # (a root input may hold -inf on purpose, an additive attention mask: it is the
        # input's only when something the model made went non-finite)
        producers[INPUT_NAME] = None
    propagators = dict.fromkeys(
        names[rec.calls[c].layer] for c in sorted(out_bad) if c in in_bad and rec.calls[c].layer < n
    )
    last_finite_child = None
    if made and rec.calls[made[0]].layer >= n:
        children = [c for c in rec.ended if rec.calls[c].parent == made[0] and c not in out_bad]
        last_finite_child = names[rec.calls[children[-1]].layer] if children else None
    start_of_layer: dict[int, float] = {}
    for call, t in bwd_start.items():
        layer = rec.calls[call].layer
        start_of_layer[layer] = min(start_of_layer.get(layer, math.inf), t)
    return ForwardFinding(
        list(producers),
        [p for p in propagators if p not in producers],
        start_of_layer,
        last_finite_child,
        list(dict.fromkeys(names[rec.calls[c].layer] for c in weight_made)),
        bool(out_bad),
    )


class Attribution:
    """The first NaN/Inf of one model's run (publisher thread only)."""

    def __init__(
        self,
        names: list[str],
        *,
        device: str = "cpu",
        replay_unavailable: str | None = None,
        gradients_every_step: bool = True,
    ):
        self._names = names
        # every step's gradients checked (nonfinite_check="all"): only then do the counters
        # tell whether a non-finite update was applied before a step (the weights' evidence)
        self._every_step = gradients_every_step
        self._device = device
        self._unavailable = replay_unavailable  # why no step can be replayed in this run
        self._counters: dict[str, list[int]] | None = None
        self._sampled: dict[int, ForwardFinding] = {}  # steps whose forward saw a NaN/Inf
        self._backward: dict[
            int, dict[int, float]
        ] = {}  # step with a non-finite gradient -> backward starts
        self._replayed: dict[
            int, tuple[ForwardFinding, int]
        ] = {}  # step -> (finding, updates since)
        self._not_replayed: dict[int, str] = {}
        self._capsules: list[
            str
        ] = []  # incident capsules written (capsule.py): the first is the event's
        self.event: NonFiniteEvent | None = None

    # ---------------- what was observed ----------------

    def counters(self, counters: dict[str, list[int]]) -> None:
        """The device counters, as the aggregator merged every drain so far."""
        self._counters = counters

    def sampled(self, step: int, finding: ForwardFinding, backward_bad: bool = False) -> None:
        """A sampled step's forward, with its per-layer checks (and whether any of its
        gradients was non-finite: then its backward order is kept)."""
        if finding.saw_nonfinite:
            self._sampled[step] = finding
        if backward_bad:
            self._backward[step] = finding.bwd_start_of_layer

    def _prune(self) -> None:
        """Steps before the first bad one are clean (the counters say so); past
        KEPT_FINDINGS the latest steps go, never the earliest. Both depend only on what was
        observed, not on the order it came in."""
        first = self._first()
        for kept in (self._sampled, self._backward):
            for step in [s for s in kept if first is not None and s < first]:
                del kept[step]
            for step in sorted(kept, reverse=True)[: max(0, len(kept) - KEPT_FINDINGS)]:
                del kept[step]

    def _first(self) -> int | None:
        """The first bad step of any phase, once the counters have one."""
        c = self._counters
        firsts = [s for s in c["phase_first"] if s >= 0] if c is not None else []
        return min(firsts) if firsts else None

    def replayed(self, step: int, finding: ForwardFinding, moved: int = 0) -> None:
        """The forward of `step` was replayed with the per-layer checks on, `moved` updates
        after it (0: on that forward's very weights)."""
        self._replayed[step] = (finding, moved)

    def not_replayed(self, step: int, why: str) -> None:
        """The forward of `step` went non-finite and could not be replayed, for `why`."""
        self._not_replayed[step] = why

    def capsule_written(self, path: str) -> None:
        """The incident capsule of the run's replayed NaN/Inf was written to `path`."""
        self._capsules.append(path)

    @property
    def capsules_written(self) -> int:
        return len(self._capsules)

    # ---------------- the answer ----------------

    def decide(self) -> NonFiniteEvent | None:
        """The first NaN/Inf from everything observed (the same whatever the order it came
        in); kept as `event`."""
        c = self._counters
        if c is None:
            return self.event
        firsts = [
            (c["phase_first"][PHASE_INDEX[p]], order, p)
            for order, p in enumerate(("forward", "loss", "backward"))
            if c["phase_first"][PHASE_INDEX[p]] >= 0
        ]
        if not firsts:
            return self.event
        first, _, phase = min(firsts)
        self._prune()
        if phase == "forward":
            event = self._forward(first, c["phase_first"][PHASE_INDEX["backward"]])
        elif phase == "loss":
            event = NonFiniteEvent(
                LOSS_LAYER, phase, first, found_by=FoundBy.LOSS, device=self._device
            )
        else:
            event = self._backward_first(first, c["layer_first"])
        self.event = (
            dataclasses.replace(event, capsule=self._capsules[0]) if self._capsules else event
        )
        return self.event

    def _forward(self, first: int, backward_first: int) -> NonFiniteEvent:
        def clean_before(step: int) -> bool:
            # no non-finite gradient before `step`, so no non-finite update was applied
            # before its forward: every layer's weights were still what the run made them
            return not 0 <= backward_first < step

        # the forward of `first` itself, then later ones while nothing had poisoned them
        seen: list[tuple[int, int, ForwardFinding]] = [
            (step, 0, f) for step, f in self._sampled.items() if step >= first
        ]
        seen += [(step, 1, f) for step, (f, _) in self._replayed.items() if step >= first]
        layer, found_by, last_child, unproven = None, None, None, None
        propagators: tuple[str, ...] = ()
        for step, replay, finding in sorted(seen, key=lambda s: (s[0] != first, s[0], s[1])):
            if step != first and not clean_before(step):
                continue
            if finding.producers:
                layer, propagators = finding.producers[0], tuple(finding.propagators)
                last_child = finding.last_finite_child
                found_by = (
                    FoundBy.INPUT
                    if layer == INPUT_NAME
                    else FoundBy.REPLAY
                    if replay
                    else FoundBy.SAMPLED
                )
                break
            if finding.weight_producers and clean_before(step):
                if not self._every_step:  # nothing says no update made those weights so
                    unproven = unproven or WEIGHTS_UNPROVEN
                    continue
                layer, propagators = finding.weight_producers[0], tuple(finding.propagators)
                found_by = FoundBy.WEIGHTS
                break
        outcome, note = self._replay_of(first)
        if layer is None and outcome == ReplayOutcome.REPRODUCIBLE and unproven:
            note = unproven
        return NonFiniteEvent(
            layer, "forward", first, propagators, last_child, found_by, outcome, note, self._device
        )

    def _replay_of(self, first: int) -> tuple[ReplayOutcome | None, str | None]:
        """What replaying `first` said: reproducible, transient, not replayed (and why), or
        nothing yet."""
        replayed = self._replayed.get(first)
        if replayed is not None:
            finding, moved = replayed
            if finding.saw_nonfinite:
                return ReplayOutcome.REPRODUCIBLE, None
            if moved:  # finite on other weights proves nothing of the step's own
                return ReplayOutcome.NOT_REPLAYED, LATER_WEIGHTS
            if first in self._not_replayed:  # a finite replay with a caveat (replay.COMPILED_RNG)
                return ReplayOutcome.NOT_REPLAYED, self._not_replayed[first]
            return ReplayOutcome.TRANSIENT, None
        if first in self._not_replayed:
            return ReplayOutcome.NOT_REPLAYED, self._not_replayed[first]
        if self._unavailable is not None:
            return ReplayOutcome.NOT_REPLAYED, self._unavailable
        return None, None

    def _backward_first(self, first: int, layer_first: list[int]) -> NonFiniteEvent:
        bad = [i for i, s in enumerate(layer_first) if s == first]
        if not bad:
            return NonFiniteEvent(None, "backward", first, device=self._device)
        # the first to go bad in backward: earliest backward start when it was timed on this
        # step, else the last layer in module order (backward runs roughly in reverse)
        starts = self._backward.get(first, {})
        chosen = min(bad, key=lambda i: (starts.get(i, math.inf), -i))
        return NonFiniteEvent(
            self._names[chosen],
            "backward",
            first,
            tuple(self._names[i] for i in bad if i != chosen),
            found_by=FoundBy.BACKWARD,
            device=self._device,
        )
