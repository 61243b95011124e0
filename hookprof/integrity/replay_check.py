"""The scheduled replay check (Config.sdc_check_interval_s, issue 43 items 3 and 4): on a check
step, its forward is replayed before the update (the step's own inputs, weights, RNG state and
autocast; step_events.py runs nonfinite/replay.py's `forward_again`), and every layer's output
is compared bitwise with the step's own, on the device: each output's bits summed as integers
(tensors.output_checksum) by the layer hooks, in both forwards, then compared pairwise.

The verdict, on the publisher thread (`ReplayVerdicts`): *reproduced* when every output is
the same bits, which is what a deterministic forward on a sound device gives; *not
reproduced* when one differs, naming the first layer, in call order, whose output differs:
the layer where a wrong value entered the forward (a device that computed wrongly, or
nondeterminism: a verdict also says whether torch's deterministic algorithms were on);
*not compared* when the step could not be replayed as it ran (several forwards in the step,
inputs edited in place, no optimizer hook before the update, ...), with the reason.

A replay runs no collective: in a process that is one of several ranks, where a model's code
may hold one (SyncBatchNorm), it is not run; the replica check (integrity/replicas.py)
compares the ranks instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from hookprof.snapshot import ReplayMismatch

REPRODUCED, NOT_REPRODUCED, NOT_COMPARED = "reproduced", "not_reproduced", "not_compared"
RESULTS = (REPRODUCED, NOT_REPRODUCED, NOT_COMPARED)

# why a check step was not compared
SEVERAL_FORWARDS = "several training forwards in the step"
NO_UPDATE_HOOK = "the step ended before an optimizer hook saw its update begin"
SEVERAL_RANKS = "one rank of several (a replay could start a collective the others never join)"
SHARDED = "the parameters are DTensors (FSDP2, tensor parallel)"
NO_RECORD = "no layer hooks on the step (a compiled model, or hooks switched off by a fault)"
NOT_CAPTURED = (
    "no training forward of the step had run when its update began (a closure optimizer "
    "runs it inside its step)"
)
COMPILED_REGIONS = "layers inside compiled regions (their eager replay is not what ran)"
CALLS_DIFFER = "the replay called other layers than the step (state the forward kept in Python)"
REPLAY_FAILED = "the replay raised"
INPUTS_EDITED = "an input of the forward was edited in place since it began"
# (a momentum encoder MoCo's forward updates: a replay would update it twice)
PARAMETERS_WRITTEN = "the forward wrote parameters (a replay would write them again)"


@dataclass(frozen=True, slots=True)
class Comparison:
    """One check step's comparison as it leaves the training thread: for each output of the
    step's forward in call order, its layer (`layers`); the device flags "this output
    differs", one stack per device, hold the outputs at `order` (positions in `layers`).
    `diverged`: the first position at which the two forwards' calls differ on the host
    (another layer, or another number of outputs); `refused`: why nothing was compared."""

    step: int
    layers: tuple[int, ...] = ()
    order: tuple[int, ...] = ()
    diverged: int | None = None
    refused: str | None = None
    deterministic: bool = False  # torch.are_deterministic_algorithms_enabled() at the replay
    capsule: str | None = None  # the mismatch's capsule (capsule_dir: check_capsule.py)


def compare_sums(
    ours: Sequence[tuple[int, torch.Tensor]], theirs: Sequence[tuple[int, torch.Tensor]]
) -> tuple[tuple[int, ...], tuple[int, ...], int | None, list[torch.Tensor]]:
    """Two forwards' (layer, output sum) in call order, compared on the device: (each of ours'
    layer, the positions compared in the order of the flags, the first position at which the
    calls differ on the host or None, the flags "this output differs", one stack per device).
    Nothing is read back."""
    layers = tuple(layer for layer, _ in ours)
    diverged = next(
        (k for k, (a, b) in enumerate(zip(ours, theirs)) if a[0] != b[0]),
        None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
    )
    compared = len(ours) if diverged is None else diverged
    by_device: dict[torch.device, list[int]] = {}
    for k in range(compared):
        by_device.setdefault(ours[k][1].device, []).append(k)
    parts = [
        torch.stack([ours[k][1] != theirs[k][1] for k in positions]).to(torch.float64)
        for positions in by_device.values()
    ]
    order = tuple(k for positions in by_device.values() for k in positions)
    return layers, order, diverged, parts


def first_differing(order: Sequence[int], flags: Sequence[float]) -> int | None:
    """The first position, in call order, whose flag (read on the host) says it differs."""
    differs = dict(zip(order, flags))
    return next((k for k in sorted(differs) if differs[k]), None)


class ReplayCheck:
    """The training thread's side: what a check step's forward was, and the comparison."""

    @classmethod
    def of(cls, config: Any, names: Sequence[str], capsules: Any = None) -> ReplayCheck | None:
        """The check of a model whose layers are `names` (None: sdc_check_interval_s off);
        `capsules`: nonfinite/check_capsule.py's CheckCapsules, with capsule_dir set."""
        if config.sdc_check_interval_s is None:
            return None
        return cls(len(names), names, capsules)

    def __init__(self, n_layers: int, names: Sequence[str] = (), capsules: Any = None):
        self._n_layers = n_layers  # calls of rows past the layers (containers) are not compared
        self._names = names  # the layers' names (for a mismatch's capsule)
        # capsule_dir set: a mismatch's capsule is written in the check step (check_capsule.py)
        self.capsules = capsules
        self.step: int | None = None  # the check step in progress
        self._captured: Any = None
        self._start: Any = None  # the modules' state as the forward began
        self.marks: Any = None  # the parameters' write marks then (fingerprint.write_marks)
        self._forwards = 0
        self.refused: str | None = None

    @property
    def armed(self) -> bool:
        """A check step whose comparison has not been made yet."""
        return self.step is not None

    def begin(self, number: int, refused: str | None = None) -> None:
        self.step, self._forwards, self.refused = number, 0, refused
        self._captured = self._start = self.marks = None

    @property
    def wants_forward(self) -> bool:
        """Is the next training forward one to capture (the check step's first)?"""
        return self.step is not None and self.refused is None and self._forwards == 0

    def note_forward(self, captured: Any, start: Any, marks: Any = None) -> None:
        """A training forward of the armed check step began; `captured`: its inputs and RNG
        state (nonfinite/replay.py CapturedForward), `start`: the modules' state then
        (state_at_forward_start), `marks`: its parameters' write marks then. A second forward
        (micro-batches) makes the step one a single replay cannot match: nothing is kept."""
        if self.step is None:
            return  # (a forward after the comparison, a closure's: not the check's)
        self._forwards += 1
        if self._forwards == 1:
            self._captured, self._start, self.marks = captured, start, marks
        else:
            self._captured = self._start = self.marks = None
            self.refused = SEVERAL_FORWARDS

    def take(self) -> tuple[int, Any, Any]:
        """(the check step, its captured forward or None, the state it began from); the step
        is no longer armed, and nothing of its forward is kept here."""
        assert self.step is not None
        step, captured, start = self.step, self._captured, self._start
        if captured is None and self.refused is None:
            self.refused = NOT_CAPTURED
        self.step, self._captured, self._start = None, None, None
        return step, captured, start

    def refusal(self, step: int, reason: str) -> Comparison:
        self.step, self._captured, self._start, self.marks = None, None, None, None
        return Comparison(step, refused=reason)

    def compare(
        self, step: int, original: Any, replayed: Any
    ) -> tuple[Comparison, list[torch.Tensor]]:
        """The two forwards' output sums (StepRecord.fingerprints) compared: the comparison
        and its device flags, one stack per device (nothing is read back)."""
        layers, order, diverged, parts = compare_sums(
            self.outputs(original), self.outputs(replayed)
        )
        deterministic = torch.are_deterministic_algorithms_enabled()
        comparison = Comparison(step, layers, order, diverged, None, deterministic)
        return comparison, parts

    def keep_mismatch(
        self,
        comparison: Comparison,
        parts: list[torch.Tensor],
        model: Any,
        captured: Any,
        start: Any,
        original: Any,
        replayed: Any,
    ) -> Comparison:
        """With capsule_dir set: when an output differs, the step's capsule written now,
        while its weights are the step's (check_capsule.py); `comparison` with its path."""
        if self.capsules is None:
            return comparison
        ours, theirs = self.outputs(original), self.outputs(replayed)
        compared = len(ours) if comparison.diverged is None else comparison.diverged
        path = self.capsules.keep(
            model,
            captured,
            start,
            [self._names[layer] for layer, _ in ours[:compared]],
            [total for _, total in ours[:compared]],
            [total for _, total in theirs[:compared]],
            (comparison.order, parts),
            step=comparison.step,
            deterministic=comparison.deterministic,
        )
        return comparison if path is None else dataclasses.replace(comparison, capsule=path)

    def outputs(self, record: Any) -> list[tuple[int, torch.Tensor]]:
        """(layer, output sum) of a record's layer calls, in call order (containers' left out:
        only a replay hooks them)."""
        calls = record.calls
        return [
            (calls[call].layer, total)
            for call, total in record.fingerprints
            if calls[call].layer < self._n_layers
        ]


@dataclass
class ReplayVerdicts:
    """The publisher's side: each comparison judged, counted by result, the last mismatch
    kept (see the module's docstring)."""

    names: Sequence[str]
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    last_mismatch: ReplayMismatch | None = None
    last_refusal: str | None = None
    capsules: int = 0  # the mismatches' capsules written (check_capsule.py)

    def judge(self, comparison: Comparison, flags: Sequence[float]) -> str:
        """`flags`: the comparison's device flags as read on the host, stacks in order."""
        if comparison.refused is not None:
            self.counts[NOT_COMPARED] += 1
            self.last_refusal = comparison.refused
            return NOT_COMPARED
        first = first_differing(comparison.order, flags)
        if first is None and comparison.diverged is not None:
            # the calls parted with every output before alike: a difference of the host's
            # (Python state the replay did not see as it was), not a device's value
            self.counts[NOT_COMPARED] += 1
            self.last_refusal = CALLS_DIFFER
            return NOT_COMPARED
        if first is None:
            self.counts[REPRODUCED] += 1
            return REPRODUCED
        layer = comparison.layers[first]
        self.counts[NOT_REPRODUCED] += 1
        self.capsules += comparison.capsule is not None
        self.last_mismatch = ReplayMismatch(
            comparison.step,
            self.names[layer],
            comparison.deterministic,
            time.time(),
            comparison.capsule,
        )
        return NOT_REPRODUCED

    def view(self) -> Mapping[str, int]:
        return MappingProxyType(dict(self.counts))
