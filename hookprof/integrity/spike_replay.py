"""The spike verdict (Config.spike_replay, issue 43 item 2): was a spike the data or the machine?

A loss or gradient-norm spike (publish/spikes.py) is judged on the publisher thread, after
the step's update, when the weights the step ran with are gone. To replay it, what the step
ran from must still be there when it is known to be a spike, so this check, off by default,
keeps on every step (while it is armed):

- its forward's inputs and RNG state (references: nonfinite/replay.py `capture`) and the
  modules' state as the forward began (`state_at_forward_start`: copies of the buffers);
- the bit sum of each of its output's tensors (tensors.output_checksum: exact, order-free), on the
  device, a few ops;
- a copy of the trained parameters as its update begins (one `_foreach_copy_`: the
  parameters' size in memory, once, and one copy of them per step).

At the step's end its loss (`prof.step(loss)`) and gradient norm (the every-step series) are
compared with the spike watch's current limits on the device: a gate, looser than the rule
(half its threshold and margin: publish/spikes.py `gate_limits`), so that the steps the
publisher will judge spikes are among those replayed; on a step that measures updates,
each measured layer's update ratio is gated the same way against its own window
(integrity/update_replay.py `_gate_step`, `gate_also`): an update ratio jump's gradients
are replayed too. The gate's flag is read as the next
step's update begins, before the copy is taken again: at once on a CPU; on a GPU one wait
for the previous step's flag, which the device has usually delivered by then (it runs
behind the host by less than a step). A step whose gate tripped is replayed there: the
parameters copied aside, the step's own put back, its forward run again eagerly from its
inputs, RNG and modules' state (nonfinite/replay.py `forward_again`, which puts the buffers
and RNG back), then its backward from the gradients the step's own backward brought the
model's outputs (kept by reference, when no larger than the parameters), the parameters
restored; its output's bit sums, every layer's, every layer output's gradient's (in the
order the backward computed them) and every parameter's gradient's (taken as the step's
backward ended, before a clip rewrites them) compared with the step's on the device. The verdict rides
a packet to the publisher (`SpikeReplays`):

- *reproduced*: the same bits. The same batch on the same weights gives the same spike: the
  data (or the model's numerics), not the machine; the batch of that step is the suspect;
- *not reproduced*: the device computed the step differently the second time: the machine
  (or a nondeterministic kernel: whether deterministic algorithms were on is said);
- *not compared*, with the reason: the step could not be replayed as it ran (several
  forwards, inputs edited in place, no optimizer hook, a compiled model, one rank of several).

Training is unchanged bit for bit: the replay writes nothing the step or the next one reads.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from hookprof.device import transfer
from hookprof.distributed import with_other_ranks
from hookprof.integrity.replay_check import (
    CALLS_DIFFER,
    COMPILED_REGIONS,
    INPUTS_EDITED,
    NOT_COMPARED,
    NOT_REPRODUCED,
    REPLAY_FAILED,
    REPRODUCED,
    RESULTS,
    SEVERAL_FORWARDS,
    SEVERAL_RANKS,
    SHARDED,
    compare_sums,
    first_differing,
)
from hookprof.layers import ROOT_NAME
from hookprof.snapshot import ReplayMismatch, Suspect, suspects_from
from hookprof.step.output_sums import GradientSums, OutputSums, get_gradient_edge
from hookprof.tensors import iter_tensors, output_checksum, summable

NO_UPDATE = "the step's update began without an optimizer hook (its weights were not kept)"
COMPILED = "the model's forward is compiled (an eager replay is not the code that ran)"
NO_OUTPUT = "the step's forward had no floating-point output to compare"
SUSPECTS = 5  # samples of a spike's batch named, by loss
_GRAD = operator.attrgetter("grad")
# the first differing output was the model's, and its layers were not compared (a fault in
# their sums, or more calls than are kept: step/output_sums.py)
OUTPUT_NAME = "(output)"
NOT_CAUGHT = "no training forward of the model was seen on that step"
PARAMETERS_REPLACED = (
    "the model's parameters were replaced since the step (load_state_dict(assign=True))"
)
# why a replay compared the forward alone (its backward not replayed)
NO_GRADIENT = "the model's output needed no gradient"
GRADIENT_TOO_LARGE = "the gradient of the model's output is larger than its parameters"
GRADIENT_MISSED = "no backward through the model's output was seen before the step ended"
GRADIENT_WRITTEN = "the gradient of the model's output was written since the step, or came twice"
OUTPUTS_DIFFER = "the replay's outputs that need a gradient are not the step's"
OUTPUTS_OVERLAP = (
    "one of the model's outputs is computed from another (a loss computed inside the model "
    "from its logits): their gradients overlap"
)
NO_GRADIENT_EDGES = "this torch has no torch.autograd.graph.get_gradient_edge (torch < 2.2)"
NOT_CALIBRATED = "no healthy step's replayed backward has reproduced yet in this run"
UPDATE_NOT_CALIBRATED = (
    "no second run of a measured step's update has reproduced yet in this run (an optimizer "
    "whose kernels are not bit-stable)"
)
CALIBRATION_TRIES = 3  # healthy steps replayed at most, to see that the backward reproduces
# a trusted backward is checked again on a healthy step this many steps later (a loop whose
# loss changes after its warm-up: an auxiliary term added from some step on); one replay
# per 1,000 steps
RECHECK_STEPS = 1000
NO_LAYER_GRADIENTS = "no layer's output needed a gradient"
SEVERAL_BACKWARDS = "the step ran more than one backward through the layers' outputs"
BACKWARD_ORDER = "the replayed backward computed the layers' gradients in another order"
GRADIENTS_PARTIAL = "the layers' output gradients were not all summed (a fault, too many)"
BACKWARD = 1 << 30  # added to a layer's row: the gradient of its output, not the output
# why a replay compared the layers' output gradients but not the parameters' own
PARAMETER_HOOKS = (
    "a parameter has a gradient hook of the loop's (the replay would run it once more; a "
    "post-accumulate hook edits .grad after its sum)"
)
PARAMETERS_NOT_SUMMABLE = "a parameter's gradient has no bits to sum (sparse)"
PARAMETERS_ACCUMULATED = (
    "every parameter's .grad held a value as the step's backward began "
    "(zero_grad(set_to_none=False), gradients kept across steps): what the backward added "
    "cannot be told from it"
)
PARAMETERS_DIFFER = "the replay's backward reached other parameters than the step's"
PARAMETERS_NOT_CALIBRATED = "no healthy step's replayed parameter gradients have reproduced yet"
PARAMETER = 1 << 31  # added to a parameter's position: its gradient (a row past the layers')


@dataclass(frozen=True, slots=True)
class SpikeComparison:
    """One gated step's replay as it leaves the training thread; its device flags ("this
    output tensor differs") ride the packet."""

    step: int
    refused: str | None = None
    deterministic: bool = False
    capsule: str | None = None  # a difference's capsule (capsule_dir set)
    # each compared output's layer, in call order: the layers' (while the layer sums were
    # collected whole), then the model's output as ROOT_NAME (or the entry module's name;
    # OUTPUT_NAME when the layers were not compared);
    # the flags come in `order`; `diverged`: where the two forwards' calls parted
    layers: tuple[str, ...] = ()
    order: tuple[int, ...] = ()
    diverged: int | None = None
    # the samples of largest loss ride after the flags: k losses, k indices, the total
    suspects: int = 0
    # where `layers` goes on with the backward: the gradients of the layers' outputs, in the
    # order the backward computed them (None: the backward was not compared, `backward_off`
    # says why)
    backward_from: int | None = None
    backward_off: str | None = None
    # where `layers` goes on with the parameters' own gradients, by name, in the order their
    # layers' backwards ran (None: not compared, `params_off` says why)
    params_from: int | None = None
    params_off: str | None = None
    # where `layers` goes on with the parameters' updates, by name: an update ratio jump's
    # second run of the optimizer's update (integrity/update_replay.py)
    update_from: int | None = None


@dataclass
class _Step:
    """What one step ran from (see the module's docstring)."""

    step: int
    captured: Any = None
    start: Any = None
    sums: list[torch.Tensor] = field(default_factory=list)
    refused: str | None = None
    forwards: int = 0
    kept_weights: bool = False  # the parameters were copied as its update began
    # (layer, output sum) of its forward's layer calls (step/output_sums.py); None: not
    # collected, or not whole
    layers: list[tuple[int, torch.Tensor]] | None = None
    # ... their gradients' sums as its backward computed them (None: not collected)
    grads: GradientSums | None = None
    # the gradient of each summed output tensor of the model, kept by reference as the
    # backward made it: the replay's backward starts from it (the loop's loss is not the
    # model's)
    output_grads: _OutputGradients | None = None
    backward_off: str | None = None  # why its backward cannot be replayed (None: it can)
    # the bit sum of each parameter's gradient as its backward ended (positions: which
    # parameters, those that had one), before a clip or an unscale rewrites them; None:
    # not taken, `params_off` says why
    param_positions: tuple[int, ...] = ()
    param_sums: list[torch.Tensor] | None = None
    params_off: str | None = None
    backward_ends: int = 0
    # prof.step(loss, sample_losses=...): the loss of each sample of its batch (a reference)
    # and its version counter then
    sample_losses: tuple[torch.Tensor, int] | None = None
    # its loss or gradient norm passed the rule's own limit (the gate's), and the step
    # before's did not
    first_spiked: bool = False
    gate: list[Any] = field(default_factory=list)  # its gate's flags on their way (Copy)


class SpikeReplay:
    """The training thread's side (see the module's docstring)."""

    def __init__(
        self,
        limits: Callable[[], tuple[float, float, float, float]],
        forward_again: Callable[[Any, Any, Any], Any],
        *,
        model: Callable[[], nn.Module | None] = lambda: None,
        capsules: Any = None,
        sums: OutputSums | None = None,
        names: Sequence[str] = (),
        has_regions: Callable[[], bool] = lambda: False,
        say: Callable[[str, str], None] | None = None,
        params: Sequence[torch.Tensor] = (),
        param_names: Sequence[str] = (),
        param_layers: Sequence[int] = (),
        own_hook: Callable[[Any], bool] = lambda hook: False,
    ):
        self._model = model
        # the model's parameters (the layer table's: every one once), their names and the
        # row of the layer that owns each: their gradients compared too, named by parameter
        self._params = params
        self._param_names = param_names
        self._param_layers = param_layers
        self._own_hook = own_hook  # is a parameter's gradient hook hookprof's own?
        # modules compiled on their own below the root: an eager replay is not what ran
        self._has_regions = has_regions
        self._spiked_before = False  # the last step settled passed the rule's own limit
        # every layer's output summed on the step's first forward and on its replay: where a
        # difference entered (None: the model's output alone is compared)
        self.sums = sums
        self._names = names  # the layers' and containers' names, by row
        # capsule_dir set: a difference's capsule (nonfinite/check_capsule.py CheckCapsules)
        self._capsules = capsules
        # (captured, start, backward or None) -> the replay's output: nonfinite/replay.py
        # forward_again (`backward` runs on the output, inside the replay)
        self._forward_again = forward_again
        # (loss, gradient norm) above which a step is replayed, then (loss, gradient norm)
        # above which it is a spike (publish/spikes.py gate_limits)
        self._limits = limits
        # every parameter of the model as the last step's first update began (trained or
        # not: a frozen or EMA copy inside the model is read by the forward as well)
        self._kept: list[torch.Tensor] | None = None
        self._kept_ids: list[int] = []  # ... which parameters they were
        self._kept_step: int | None = None
        self._current: _Step | None = None  # the step whose forward runs
        self._ended: _Step | None = None  # the last step ended, its gate on its way
        self._param_bytes: int | None = None  # the parameters' size (output gradients' budget)
        # does this run's backward reproduce on a healthy step (`_calibrate`)? None: not
        # known yet; False: spikes compare their forward only, `_backward_distrust` says why
        self._backward_trusted: bool | None = None
        self._backward_distrust: str | None = None
        self._calibration_tries = 0
        self._recheck_at = 0  # (the step from which a trusted backward is checked again)
        # ... and do the parameters' own gradients reproduce on it? (a weight penalty the
        # loop adds to its loss reaches them outside the model's output: they differ then,
        # and spikes compare the layers' output gradients only)
        self._params_trusted: bool | None = None
        self._params_distrust: str | None = None
        self._params_tries = 0
        self._say = say

    def forward_began(
        self,
        step: int,
        capture: Callable[[], Any],
        start: Callable[[], Any],
        refused: str | None = None,
    ) -> None:
        """A training forward of step `step` begins: the first is kept (`capture()`: its
        inputs and RNG, `start()`: the modules' state), a second refuses the step, as does
        `refused` (a compiled forward)."""
        current = self._current
        if current is None or current.step != step:
            current = self._current = _Step(step, refused=refused)
        current.forwards += 1
        if current.forwards == 1 and current.refused is None:
            current.captured, current.start = capture(), start()
            if self.sums is not None:
                current.layers, current.grads = [], GradientSums()
                self.sums.collect(current.layers, current.grads)
        elif current.forwards == 2:
            current.captured = current.start = current.layers = None
            current.grads = current.output_grads = None
            current.sums = []
            current.refused = current.refused or SEVERAL_FORWARDS
            self._stop_sums(current)

    def output(self, output: Any) -> None:
        """The first forward's output: its tensors' bit sums, on the device; and a hook on
        each that needs a gradient, which keeps the gradient the backward brings it (a
        reference), for the replay's backward, when they are no larger than the parameters
        (the copy of them kept already: the replay's memory at most doubles)."""
        current = self._current
        self._stop_sums(current)
        if current is None or current.forwards != 1 or current.refused is not None:
            return
        tensors = _output_tensors(output)
        current.sums = [output_checksum(t.detach()) for t in tensors]
        if current.grads is None:  # (the layers are not summed: no backward to compare)
            return
        needing = [t for t in tensors if t.grad_fn is not None]
        if not needing:
            current.backward_off = NO_GRADIENT
            return
        if sum(t.numel() * t.element_size() for t in needing) > self._parameter_bytes():
            current.backward_off = GRADIENT_TOO_LARGE
            return
        kept = current.output_grads = _OutputGradients(len(tensors), self._params)
        for k, t in enumerate(tensors):
            if t.grad_fn is not None:  # (weakly: see _OutputGradients)
                t.register_hook(partial(_keep_gradient, weakref.ref(kept), k))

    def backward_ended(self) -> None:
        """A backward through the model's output ended: its parameters' gradients summed as
        it left them (one bit sum each, on the device; before any clip or unscale rewrites
        them), for the replay's backward to compare its own with: those whose .grad was None
        as the backward began (its output's gradient hook noted which), so .grad holds what
        this backward made and nothing before it (a loop that does not zero some of them, a
        linear probe's backbone, zero_grad(set_to_none=False), keeps them out: found by
        review). A step of more backwards (accumulation, retain_graph) compares none, nor
        does one whose parameters carry a gradient hook of the loop's (`p.register_hook`,
        which the replay would run once more, or a post-accumulate hook, which edits .grad
        after the sum's place)."""
        current = self._current
        if (
            current is None
            or current.forwards != 1
            or current.refused is not None
            or current.grads is None
        ):
            return
        current.backward_ends += 1
        current.param_sums = None
        if current.backward_ends > 1:
            current.params_off = SEVERAL_BACKWARDS
            return
        fresh = current.output_grads.fresh if current.output_grads is not None else None
        if fresh is None:  # (no gradient reached the model's output: the backward is off too)
            current.params_off = GRADIENT_MISSED
            return
        if self._loop_hooks(self._params):
            current.params_off = PARAMETER_HOOKS
            return
        positions: list[int] = []
        sums: list[torch.Tensor] = []
        held = False  # a parameter's .grad held a value as the backward began
        for i, p in enumerate(self._params):
            grad = p.grad
            if grad is None or not p.requires_grad:
                continue
            if not fresh[i]:
                held = True
                continue
            if not summable(grad):
                current.params_off = PARAMETERS_NOT_SUMMABLE
                return
            positions.append(i)
            sums.append(output_checksum(grad.detach()))
        if held and not positions:
            current.params_off = PARAMETERS_ACCUMULATED
            return
        current.param_positions, current.param_sums = tuple(positions), sums

    def _loop_hooks(self, params: Sequence[torch.Tensor]) -> bool:
        """Does one of `params` carry a gradient hook of the loop's (not hookprof's own)?"""
        own = self._own_hook
        for p in params:
            hooks, after = p._backward_hooks, p._post_accumulate_grad_hooks
            if (hooks and not all(map(own, hooks.values()))) or (
                after and not all(map(own, after.values()))
            ):
                return True
        return False

    def _parameter_bytes(self) -> int:
        if self._param_bytes is None:
            model = self._model()
            params = model.parameters() if model is not None else ()
            self._param_bytes = sum(p.numel() * p.element_size() for p in params)
        return self._param_bytes

    def _stop_sums(self, current: _Step | None) -> None:
        """The layers' sums no longer collected; a collection that stopped short (a fault,
        too many calls) is dropped: the output is still compared, the layer not named."""
        if self.sums is not None and self.sums.stop() and current is not None:
            current.layers = None

    def update_began(self, step: int) -> tuple[SpikeComparison, list[torch.Tensor]] | None:
        """Step `step`'s first update begins: the last step's gate read (waited for, on a
        device), its replay run if it tripped, then this step's parameters kept (a second
        optimizer of the step finds them kept: the first has updated its own since). Returns
        the replay's comparison and flags to send, if one ran."""
        if self._kept_step == step:
            return None
        sent = self._settle()
        model = self._model()
        params = list(model.parameters()) if model is not None else []
        if (
            self._kept is None
            or [id(p) for p in params] != self._kept_ids
            or any(k.shape != p.shape or k.dtype != p.dtype for k, p in zip(self._kept, params))
        ):  # (the first time, or parameters replaced: load_state_dict(assign=True))
            with torch.no_grad():
                self._kept = [torch.empty_like(p) for p in params]
            self._kept_ids = [id(p) for p in params]
            self._param_bytes = None  # (measured again)
        with torch.no_grad():
            torch._foreach_copy_(self._kept, [p.detach() for p in params])
        self._kept_step = step
        if self._current is None or self._current.step != step:
            # (a closure optimizer: its forward comes inside the step, after this hook)
            self._current = _Step(step)
        self._current.kept_weights = True
        return sent

    def step_ended(
        self, step: int, loss: Any, norms: Sequence[torch.Tensor]
    ) -> tuple[SpikeComparison, list[torch.Tensor]] | None:
        """Step `step` ended with `loss` (prof.step's: a tensor, a number or None) and the
        per-device gradient norms of the every-step series: its gate started. A previous
        step's gate not read yet (this step had no update: a GradScaler skip, a hand-written
        update) is read now, while the weights kept are still its own; returns that replay's
        comparison and flags to send, if one ran."""
        sent = self._settle() if self._ended is not None else None
        current = self._current
        self._stop_sums(current)  # (a forward that raised: its root never returned)
        if current is None or current.step != step:
            current = _Step(step, refused=NOT_CAUGHT)
        self._current = None
        self._ended = current
        limits = self._limits()
        norm_gate, norm_spike = limits[1], limits[3]
        if norms and math.isfinite(norm_gate):
            # (a norm written as "no value", -1: a fused optimizer's GradScaler skip, is 0)
            squares = torch.stack([n.to(norms[0].device).clamp(min=0).square() for n in norms])
            total = squares.sum()
            over = torch.stack([total > norm_gate * norm_gate, total > norm_spike * norm_spike])
            current.gate.append(transfer.peek(over))
        self.late_loss(step, loss, limits)
        return sent

    def late_loss(
        self, step: int, loss: Any, limits: tuple[float, float, float, float] | None = None
    ) -> None:
        """prof.step(loss) after the optimizer hook ended step `step`: its loss gated too."""
        ended = self._ended
        if loss is None or ended is None or ended.step != step:
            return
        gate, spike = (limits or self._limits())[::2]
        if not math.isfinite(gate):
            return
        if isinstance(loss, torch.Tensor):
            with torch.no_grad():
                value = loss.detach().reshape(()).double()
                ended.gate.append(transfer.peek(torch.stack([value > gate, value > spike])))
        elif float(loss) > gate:
            ended.gate.append(transfer.Copy((True, float(loss) > spike), None))

    def gate_also(self, step: int, over: torch.Tensor) -> None:
        """Another gate of step `step`'s, on the device: (past the gate, past the rule's own
        limit), as the loss's and the gradient norm's (an update ratio's: integrity/
        update_replay.py), read with them as the next update begins."""
        ended = self._ended
        if ended is not None and ended.step == step:
            ended.gate.append(transfer.peek(over))

    def sample_losses(self, values: torch.Tensor) -> None:
        """prof.step(loss, sample_losses=...): the per-sample losses of the step in progress
        (or of the one the optimizer hook just ended), kept by reference for its replay."""
        target = self._current if self._current is not None else self._ended
        if target is not None:  # (its version: a buffer the loop writes again is dropped)
            target.sample_losses = (values.detach(), values._version)

    def _settle(self) -> tuple[SpikeComparison, list[torch.Tensor]] | None:
        ended, self._ended = self._ended, None
        if ended is None:
            return None
        tripped = spiked = False
        for copy in ended.gate:
            transfer.wait_ready(copy.ready)  # note: a CPU-GPU sync point (opt-in spike_replay)
            over = copy.host.tolist() if isinstance(copy.host, torch.Tensor) else copy.host
            tripped = tripped or bool(over[0])  # (past the gate: replayed)
            spiked = spiked or bool(over[1])  # (past the rule's own limit)
        # a spike's first step (the rule's own limit passed, not by the step before): the
        # steps of one going on stay past the limit too, and would use up capsule_max_count
        ended.first_spiked = spiked and not self._spiked_before
        self._spiked_before = spiked
        if not tripped:
            if self._backward_trusted is None or (
                self._backward_trusted
                and (self._params_trusted is None or ended.step >= self._recheck_at)
            ):
                self._calibrate(ended)
            return None
        return self._replay(ended)

    def _calibrate(self, ended: _Step) -> None:
        """A healthy step replayed once (up to CALIBRATION_TRIES, until one compares its
        backward), its flags read here: does this run's backward reproduce at all? A loop
        that adds a gradient of its own to an activation inside the model (an auxiliary loss
        on a block's output, a hook) or a nondeterministic backward kernel makes a healthy
        step's gradients differ, and every spike's backward would then blame the machine;
        so a run whose healthy step does not reproduce compares the forward only, and says
        so once (found by review). Nothing is sent: this step was no spike."""
        if ended.refused is not None or not ended.kept_weights:
            return  # (a step no replay could run, GradScaler's first skips: not a try)
        why = self._backward_off(ended, self.sums if ended.layers is not None else None)
        comparison: SpikeComparison | None = None
        parts: list[torch.Tensor] = []
        if why is None:  # (no replay where one is not needed to see it cannot compare)
            comparison, parts = self._replay(ended, calibrating=True)
            if comparison.refused is not None or comparison.backward_from is None:
                why = comparison.refused or comparison.backward_off or GRADIENTS_PARTIAL
        if why is not None or comparison is None:  # (a recheck waits for the next one)
            if self._backward_trusted is None:
                self._calibration_tries += 1
                if self._calibration_tries >= CALIBRATION_TRIES:
                    self._distrust(ended.step, why or GRADIENTS_PARTIAL)
            elif comparison is not None and self._params_trusted is None:
                # (a replay ran for the parameters: a try of theirs, or every healthy step
                # would be replayed while they stay unknown; found by review)
                self._calibrate_params(ended.step, comparison, None)
            return
        assert comparison.backward_from is not None
        # (a device read: once a check)
        differs = dict(zip(comparison.order, (float(f) for p in parts for f in p.tolist())))
        params_from = comparison.params_from
        flagged = [k for k in sorted(differs) if differs[k]]
        first = next((k for k in flagged if params_from is None or k < params_from), None)
        if first is None:
            self._backward_trusted = True
            self._recheck_at = ended.step + RECHECK_STEPS
            param = next((k for k in flagged if params_from is not None and k >= params_from), None)
            self._calibrate_params(ended.step, comparison, param)
            return
        self._backward_trusted = False
        phase = "forward" if first < comparison.backward_from else "backward"
        what = (
            f"its forward (first at {comparison.layers[first]}'s output): spike verdicts of "
            "this run may blame the machine for what the model does differently each time (a "
            "random generator of its own, state the replay cannot put back)"
            if phase == "forward"
            else f"its backward (first at the gradient of {comparison.layers[first]}'s output): "
            "the loop adds a gradient of its own to an activation inside the model (an "
            "auxiliary loss, a hook), or a backward kernel is nondeterministic"
        )
        self._backward_distrust = (
            f"a healthy step's replay (step {ended.step}) did not reproduce {phase}"
        )
        if self._say is not None:
            self._say(
                "spike replay backward",
                f"spike_replay: a healthy step's replay (step {ended.step}) did not reproduce "
                f"{what}; the spikes of this run are judged on their forward only",
            )

    def _calibrate_params(self, step: int, comparison: SpikeComparison, first: int | None) -> None:
        """The parameters' own gradients on the healthy step whose layers' output gradients
        reproduced: trusted when they reproduced too; else the run's spikes compare the
        layers' output gradients only, said once (a weight penalty in the loop's loss, or a
        hook of its own, adds to a parameter's gradient outside the model's output)."""
        if comparison.params_from is None:  # (not compared on this step: a try)
            if self._params_trusted is None:
                self._params_tries += 1
                if self._params_tries >= CALIBRATION_TRIES:
                    self._params_trusted = False
                    why = comparison.params_off or comparison.refused or PARAMETERS_DIFFER
                    self._params_distrust = f"no healthy step's parameter gradients compared: {why}"
                    if self._say is not None:
                        self._say(
                            "spike replay parameters",
                            f"spike_replay: no healthy step's parameter gradients could be "
                            f"compared by step {step} ({why}); the spikes of this run compare "
                            "the layers' output gradients, not the parameters' own",
                        )
            return
        if first is None:
            self._params_trusted = True
            return
        self._params_trusted = False
        name = comparison.layers[first]
        self._params_distrust = (
            f"a healthy step's replay (step {step}) did not reproduce {name}'s gradient"
        )
        if self._say is not None:
            self._say(
                "spike replay parameters",
                f"spike_replay: a healthy step's replay (step {step}) did not reproduce the "
                f"gradient of {name} (the loop adds a term of its own to the parameters' "
                "gradients: a weight penalty in its loss, a hook); the spikes of this run "
                "compare the layers' output gradients, not the parameters' own",
            )

    def _distrust(self, step: int, why: str | None) -> None:
        """No healthy step's backward could be compared (CALIBRATION_TRIES of them): the
        run's spikes compare their forward only, said once with the last reason."""
        self._backward_trusted = False
        self._backward_distrust = f"no healthy step's backward could be replayed: {why}"
        if self._say is not None:
            self._say(
                "spike replay backward",
                f"spike_replay: no healthy step's backward could be replayed by step {step} "
                f"({why}); the spikes of this run are judged on their forward only",
            )

    def _replay(
        self, ended: _Step, calibrating: bool = False
    ) -> tuple[SpikeComparison, list[torch.Tensor]]:
        refused = ended.refused
        if refused is None and not ended.kept_weights:
            refused = NO_UPDATE
        if refused is None and not ended.sums:
            refused = NO_OUTPUT
        if refused is None and ended.captured.changed_in_place():
            refused = INPUTS_EDITED
        if refused is None and self._has_regions():
            refused = COMPILED_REGIONS
        if refused is not None:
            return SpikeComparison(ended.step, refused), []
        return self._run(ended, calibrating)

    def _run(
        self, ended: _Step, calibrating: bool = False
    ) -> tuple[SpikeComparison, list[torch.Tensor]]:
        assert self._kept is not None
        model = self._model()
        params = list(model.parameters()) if model is not None else []
        if [id(p) for p in params] != self._kept_ids:
            return SpikeComparison(ended.step, PARAMETERS_REPLACED), []
        # the step's own weights swapped in as the parameters' data, and back: no copy, and
        # no version counter moves (a graph the loop still runs backward on stays valid)
        now = [p.data for p in params]
        sums = self.sums if ended.layers is not None else None
        backward_off = self._backward_off(ended, sums)
        if backward_off is None and not calibrating and not self._backward_trusted:
            backward_off = self._backward_distrust or NOT_CALIBRATED
        params_off = backward_off or ended.params_off
        if params_off is None and ended.param_sums is None:
            params_off = GRADIENTS_PARTIAL
        if params_off is None and not calibrating and not self._params_trusted:
            params_off = self._params_distrust or PARAMETERS_NOT_CALIBRATED
        # (a parameter frozen since the step's backward cannot be asked for: the others are;
        # found by review)
        taken = (
            [j for j, i in enumerate(ended.param_positions) if self._params[i].requires_grad]
            if params_off is None
            else []
        )
        capture = [self._params[ended.param_positions[j]] for j in taken]
        if capture and self._loop_hooks(capture):  # (one the loop put on since the step)
            params_off, capture = PARAMETER_HOOKS, []
        param_grads: list[Any] = []  # the replay's gradient of each of `capture`
        params_failed: list[str] = []  # why the backward with them raised (then run without)
        params_from = None
        layers_again: list[tuple[int, torch.Tensor]] = []
        grads_again = GradientSums(edges=True) if backward_off is None else None
        stopped: list[bool] = []  # the forward's collection, stopped before the backward
        left_out: list[str] = []  # why the backward did not run after all

        def backward(output: Any) -> None:
            """The replay's backward from the step's own output gradients: the gradients
            of the layers' outputs summed as it computes them, through every hooked output
            (their gradient edges as the layers returned them), and the parameters' own
            gradients taken as they come (`capture`), nothing accumulated into any .grad.
            A parameter with a hook of the loop's is not taken (its hook would run again:
            `backward_ended`); a sampled step's own hooks ignore a replay."""
            assert sums is not None and ended.output_grads is not None
            assert grads_again is not None and grads_again.edges is not None
            stopped.append(sums.stop())
            why = _backward_from(
                output, ended.output_grads, grads_again.edges, capture, param_grads
            )
            if why is not None and capture:  # (the layers' outputs alone, once more)
                params_failed.append(why)
                param_grads.clear()
                grads_again.items.clear()  # (the sums the failed try made, if any)
                grads_again.broken = False
                why = _backward_from(output, ended.output_grads, grads_again.edges)
            if why is not None:
                left_out.append(why)

        try:
            for p, kept in zip(params, self._kept):
                p.data = kept
            if sums is not None:
                sums.collect(layers_again, grads_again)
            broken = False
            try:
                output = self._forward_again(
                    ended.captured, ended.start, backward if grads_again is not None else None
                )
            finally:
                if sums is not None:
                    broken = stopped[0] if stopped else sums.stop()
            compared_layers = sums is not None and not broken
            if not compared_layers:  # (the model's output alone is compared)
                ended.layers, layers_again = [], []
            if backward_off is None and left_out:
                backward_off = left_out[0]
            entry = self._entry_name(ended.captured)
            ours = [*(ended.layers or []), *((-1, s) for s in ended.sums)]
            theirs = [*layers_again, *((-1, s) for s in _output_sums(output))]
            forward_count = len(ours)
            rows, order, diverged, parts = compare_sums(ours, theirs)
            # (a capsule's: `hookprof replay` runs the forward)
            forward_flags = (order, list(parts))
            backward_flags: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
            backward_from = None
            if backward_off is None and (
                not compared_layers or grads_again is None or grads_again.broken
            ):
                backward_off = GRADIENTS_PARTIAL
            if backward_off is None and diverged is None:  # the backward, after its forward
                assert ended.grads is not None and grads_again is not None
                b_ours = [(BACKWARD + row, total) for row, total in ended.grads.items]
                b_theirs = [(BACKWARD + row, total) for row, total in grads_again.items]
                b_rows, b_order, b_diverged, b_parts = compare_sums(b_ours, b_theirs)
                if b_diverged is not None:  # (its own verdict left out: the forward's stands)
                    backward_off = BACKWARD_ORDER
                else:  # (its flags follow the forward's: the judge reads them in `order`)
                    backward_from = forward_count
                    ours += b_ours
                    rows += b_rows
                    order += tuple(forward_count + k for k in b_order)
                    parts += b_parts
                    if params_off is None and params_failed:
                        params_off = params_failed[0]
                    if params_off is None and len(param_grads) != len(capture):
                        params_off = PARAMETERS_DIFFER
                    if params_off is None:  # (then the parameters' own, after the layers')
                        p_rows, p_order, p_parts = self._param_flags(ended, param_grads, taken)
                        params_from = len(rows)
                        rows += tuple(p_rows)
                        order += tuple(params_from + k for k in p_order)
                        parts += p_parts
                        b_order += tuple(len(b_rows) + k for k in p_order)
                        b_parts += p_parts
                    backward_flags = (b_order, b_parts)
            # (the model's output, named for where its own code ran when the layers were
            # compared, OUTPUT_NAME when they were not: no layer can be said then)
            output_name = (entry or ROOT_NAME) if compared_layers else OUTPUT_NAME
            names = [
                output_name
                if row < 0
                else self._param_names[row - PARAMETER]
                if row >= PARAMETER
                else self._names[row - BACKWARD if row >= BACKWARD else row]
                for row in rows
            ]
            deterministic = torch.are_deterministic_algorithms_enabled()
            suspects = suspects_of(*ended.sample_losses) if ended.sample_losses else None
            capsule = None
            # capsule_dir: a difference's capsule, now (and a spike's the replay reproduced:
            # its batch, when it passed the rule's limit), with its forward's sums only
            # (`hookprof replay` runs the forward); none where only the backward differed,
            # whose capsule would replay as reproduced (found by review; a forward that
            # differed, whose gradients below differ too, gets its capsule)
            if (
                self._capsules is not None
                and not calibrating
                and not (
                    backward_flags is not None
                    and _first_flagged(*forward_flags) is None
                    and _first_flagged(*backward_flags) is not None
                )
            ):
                compared = min(forward_count, len(ours) if diverged is None else diverged)
                capsule = self._capsules.keep(
                    model,
                    ended.captured,
                    ended.start,
                    [entry if row < 0 else name for row, name in zip(rows, names)][:compared],
                    [total for _, total in ours[:compared]],
                    [total for _, total in theirs[:compared]],
                    forward_flags,
                    step=ended.step,
                    deterministic=deterministic,
                    # (a reproduced spike: the first step of one, every output compared)
                    alike=ended.first_spiked and diverged is None,
                    suspects=suspects,
                )
        except Exception:
            return SpikeComparison(ended.step, REPLAY_FAILED), []
        finally:
            for p, data in zip(params, now):
                p.data = data
        comparison = SpikeComparison(
            ended.step,
            None,
            deterministic,
            capsule,
            layers=tuple(names),
            order=order,
            diverged=diverged,
            suspects=0 if suspects is None else (len(suspects) - 1) // 2,
            backward_from=backward_from,
            backward_off=backward_off,
            params_from=params_from,
            params_off=None if params_from is not None else params_off or GRADIENTS_PARTIAL,
        )
        return comparison, parts if suspects is None else [*parts, suspects]

    def _param_flags(
        self, ended: _Step, grads: Sequence[torch.Tensor | None], taken: Sequence[int]
    ) -> tuple[list[int], tuple[int, ...], list[torch.Tensor]]:
        """The replay's parameter gradients (`grads`: of the step's summed parameters at
        `taken`, their indices in `ended.param_positions`; None: the replay's backward did
        not reach it, its sum taken as 0, a gradient of zeros) against the step's sums, on
        the device: (each compared parameter's row, PARAMETER + its position, in the order
        their layers' backwards ran: the layer called last first; the positions in the
        order of the flags; one stack of flags per device)."""
        last_call: dict[int, int] = {}
        for k, (row, _) in enumerate(ended.layers or ()):
            last_call[row] = k
        assert ended.param_sums is not None
        positions = [ended.param_positions[j] for j in taken]
        sums = [ended.param_sums[j] for j in taken]
        ranked = sorted(
            range(len(positions)),
            key=lambda j: -last_call.get(self._param_layers[positions[j]], -1),
        )
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        with torch.no_grad():
            for k, j in enumerate(ranked):
                ours, grad = sums[j], grads[j]
                # (.grad was None as the step's backward began: it holds that backward's
                # gradient as it came, the bits the replay's gets)
                flag = ours != (0 if grad is None else output_checksum(grad.detach()))
                by_device.setdefault(flag.device, []).append((k, flag))
        order = tuple(k for group in by_device.values() for k, _ in group)
        parts = [
            torch.stack([flag for _, flag in group]).to(torch.float64)
            for group in by_device.values()
        ]
        return [PARAMETER + positions[j] for j in ranked], order, parts

    @staticmethod
    def _backward_off(ended: _Step, sums: OutputSums | None) -> str | None:
        """Why the step's backward cannot be replayed (None: it can)."""
        if ended.backward_off is not None:
            return ended.backward_off
        if get_gradient_edge is None:
            return NO_GRADIENT_EDGES
        if sums is None or ended.grads is None or ended.output_grads is None:
            return GRADIENTS_PARTIAL
        if ended.grads.broken:
            return GRADIENTS_PARTIAL
        if len(ended.grads.items) > ended.grads.placed:
            return SEVERAL_BACKWARDS
        kept = [k for k in ended.output_grads.kept if k is not None]
        if not kept:
            return GRADIENT_MISSED
        if not ended.grads.items:
            return NO_LAYER_GRADIENTS
        if any(grad._version != version for grad, version in kept):
            return GRADIENT_WRITTEN
        return None

    def _entry_name(self, captured: Any) -> str:
        """The module the step's forward called, by name ("": the model itself)."""
        model = self._model()
        if captured.module is None or model is None:
            return ""
        return next((n for n, m in model.named_modules() if m is captured.module), "")


def suspects_of(sample_losses: torch.Tensor, version: int) -> torch.Tensor | None:
    """The samples of a batch whose loss is largest, on the device (nothing read back): their
    losses, largest first, their indices in the batch, then the batch's total (float64, one
    tensor); a sample's loss is the sum of its row's elements (per-token losses of shape
    (batch, seq)). None when the tensor was written since its step gave it (`version`: a
    buffer the loop fills again each step holds another step's losses now)."""
    if sample_losses._version != version:
        return None
    with torch.no_grad():
        per_sample = sample_losses.reshape(sample_losses.shape[0], -1).double().sum(1)
        top = per_sample.topk(min(SUSPECTS, per_sample.numel()))
        return torch.cat([top.values, top.indices.double(), per_sample.sum().reshape(1)])


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """A forward's floating-point output tensors, in the order their sums are compared."""
    return [
        t
        for t in ((output,) if isinstance(output, torch.Tensor) else iter_tensors(output))
        if summable(t)
    ]


def _output_sums(output: Any) -> list[torch.Tensor]:
    """The bit sums of a forward's floating-point output tensors (tensors.output_checksum)."""
    return [output_checksum(t.detach()) for t in _output_tensors(output)]


class _OutputGradients:
    """The gradients the step's backward brought the model's outputs (`kept[k]`: the k-th
    summed output's, with its version counter then; None: it needs none, or none came),
    owned by its _Step alone: the outputs' hooks hold it weakly, so a loop that keeps its
    outputs (a list of predictions, a running loss) keeps no gradient alive past the step's
    judgement (found by review)."""

    __slots__ = ("kept", "params", "fresh", "__weakref__")

    def __init__(self, n: int, params: Sequence[torch.Tensor] = ()) -> None:
        self.kept: list[tuple[torch.Tensor, int] | None] = [None] * n
        self.params = params
        # as the backward began (the first output's gradient came): was each parameter's
        # .grad None? (those hold what the backward makes, and nothing before it)
        self.fresh: list[bool] | None = None


def _keep_gradient(ref: weakref.ref[_OutputGradients], k: int, grad: Any) -> None:
    """A tensor hook on the model's k-th output: its gradient kept, by reference (nothing
    changed: it returns None; a hook must never raise into the backward)."""
    holder = ref()
    if holder is not None and holder.fresh is None:  # (C-level: no Python call a parameter)
        holder.fresh = list(map(operator.is_, map(_GRAD, holder.params), repeat(None)))
    if holder is not None and isinstance(grad, torch.Tensor):
        # (a second backward through it, retain_graph: -1, which no version matches)
        holder.kept[k] = (grad, grad._version if holder.kept[k] is None else -1)


def _backward_from(
    output: Any,
    grads: _OutputGradients,
    edges: list[Any],
    params: Sequence[torch.Tensor] = (),
    param_grads: list[Any] | None = None,
) -> str | None:
    """The replay's backward: from its output, fed the step's own output gradients, down to
    `edges` (its layers' outputs' gradient edges) and `params`, whose gradients (None where
    none came) go into `param_grads`. Returns why it did not run (None: it ran)."""
    tensors = _output_tensors(output)
    pairs = [
        (t, k[0]) for t, k in zip(tensors, grads.kept) if k is not None and t.grad_fn is not None
    ]
    if len(tensors) != len(grads.kept) or not pairs:
        return OUTPUTS_DIFFER
    if _overlapping([t for t, _ in pairs]):
        return OUTPUTS_OVERLAP
    if not edges:
        return NO_LAYER_GRADIENTS
    try:
        got = torch.autograd.grad(
            [t for t, _ in pairs],
            [*edges, *params],
            [g for _, g in pairs],
            allow_unused=True,
            # (kept with the parameters: if this raises, the layers' outputs are run alone)
            retain_graph=bool(params),
        )
    except Exception as exc:  # (reentrant checkpointing refuses .grad(): said)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"the replayed backward raised {type(exc).__name__}: {first_line}"[:240]
    if param_grads is not None:
        param_grads.extend(got[len(edges) :])
    return None


def _first_flagged(order: Sequence[int], parts: Sequence[torch.Tensor]) -> int | None:
    """The first position whose flag says its output differs, the flags read on the host
    (a wait for the device: only the healthy step's check, once a run, and where a capsule
    is written, which reads its own flags too)."""
    return first_differing(order, [float(f) for p in parts for f in p.tolist()])


def _overlapping(outputs: Sequence[torch.Tensor]) -> bool:
    """Is one of `outputs` computed from another (its node reached from the other's through
    the graph), or the same output twice? Their kept gradients then overlap: each is that
    output's whole gradient, and a backward fed all of them counts the shared part twice."""
    edges: list[tuple[Any, int]] = [(t.grad_fn, t.output_nr) for t in outputs]
    if len(set(edges)) < len(edges):
        return True
    nodes = {node for node, _ in edges}
    for node, _ in edges:
        others = nodes - {node}
        seen: set[Any] = set()
        stack = [n for n, _ in node.next_functions if n is not None]
        while stack:
            n = stack.pop()
            if n in others:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(m for m, _ in n.next_functions if m is not None)
    return False


# a spike replay's verdict on a step: (result, its capsule's path, the first layer whose
# output (or output's gradient) differed, or the parameter whose gradient did, the batch's
# samples of largest loss, "forward", "backward" or "parameter_gradient": where it was)
Verdict = tuple[str, str | None, str | None, tuple[Suspect, ...] | None, str | None]


@dataclass
class SpikeReplays:
    """The publisher's side: the verdicts, counted by result; the latest kept."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    # step -> Verdict (below), the last 64 (bounded)
    verdicts: dict[int, Verdict] = field(default_factory=dict)
    capsules: int = 0  # the differences' capsules written (capsule_dir)
    last_refusal: str | None = None
    last: tuple[int, str, bool, float] | None = None  # (step, result, deterministic, when)
    # the latest not reproduced, with the first layer whose output differed
    last_mismatch: ReplayMismatch | None = None
    # update ratio jumps' verdicts by step (integrity/update_replay.py), the last 64, kept
    # apart: a loss spike of the same step has its own replay
    update_verdicts: dict[int, Verdict] = field(default_factory=dict)
    # has a second run of a measured step's update reproduced yet in this run?
    update_trusted: bool = False

    def judge_update(
        self, comparison: SpikeComparison, flags: Sequence[float], jumped: bool
    ) -> str | None:
        """A second run of a measured step's update (`comparison.update_from`), on whose
        step an update ratio jump began or not (`jumped`): judged and counted when one did,
        or when its bits differ once a recheck has reproduced in this run (a device that
        computes an update differently twice); None: not counted (a healthy step's
        recheck: the calibration)."""
        differs = (
            comparison.refused is None and first_differing(comparison.order, flags) is not None
        )
        self.update_trusted = self.update_trusted or (comparison.refused is None and not differs)
        if not jumped and not (differs and self.update_trusted):
            # (a capsule its gate wrote, the rule's limit passed on the training thread's
            # reckoning but no jump began here: written all the same, so counted)
            self.capsules += comparison.capsule is not None
            return None
        if differs and not self.update_trusted:
            comparison = dataclasses.replace(comparison, refused=UPDATE_NOT_CALIBRATED)
        return self.judge(comparison, flags, self.update_verdicts)

    def judge(
        self,
        comparison: SpikeComparison,
        flags: Sequence[float],
        verdicts: dict[int, Verdict] | None = None,
    ) -> str:
        """`flags`: the comparison's device flags as read on the host, stacks in order (then
        the batch's samples of largest loss, `suspects_of`); `verdicts`: where its verdict
        is kept (the spikes' by default)."""
        entered, suspects, phase = None, None, None
        if comparison.suspects:
            flags, (suspects, _) = (
                flags[: -2 * comparison.suspects - 1],
                suspects_from(flags[-2 * comparison.suspects - 1 :]),
            )
        if comparison.refused is not None:
            result = NOT_COMPARED
            self.last_refusal = comparison.refused
        else:
            first = first_differing(comparison.order, flags)
            if first is not None:
                result, entered = NOT_REPRODUCED, comparison.layers[first]
                backward, params = comparison.backward_from, comparison.params_from
                update = comparison.update_from
                phase = (
                    "update"
                    if update is not None and first >= update
                    else "parameter_gradient"
                    if params is not None and first >= params
                    else "backward"
                    if backward is not None and first >= backward
                    else "forward"
                )
                self.last_mismatch = ReplayMismatch(
                    comparison.step,
                    entered,
                    comparison.deterministic,
                    time.time(),
                    comparison.capsule,
                    phase,
                )
            elif comparison.diverged is not None:
                # the calls parted with every output before alike: the host's difference
                # (Python state the replay did not see as it was), not a device's value
                result, self.last_refusal = NOT_COMPARED, CALLS_DIFFER
            else:
                result = REPRODUCED
        self.counts[result] += 1
        self.capsules += comparison.capsule is not None
        kept = self.verdicts if verdicts is None else verdicts
        kept[comparison.step] = (result, comparison.capsule, entered, suspects, phase)
        if len(kept) > 64:
            del kept[min(kept)]
        self.last = (comparison.step, result, comparison.deterministic, time.time())
        return result

    def view(self) -> Mapping[str, int]:
        return MappingProxyType(dict(self.counts))


def spike_replay_of(
    config: Any,
    model: Callable[[], nn.Module | None],
    hooks: Any,
    sampled: Any,
    limits: Callable[[], tuple[float, float, float, float]],
    forward_again: Callable[..., Any],
    *,
    sharded: bool,
    say: Callable[[str, str], None],
    capsules: Any = None,
    sums: OutputSums | None = None,
    names: Sequence[str] = (),
    has_regions: Callable[[], bool] = lambda: False,
    table: Any = None,
    own_hook: Callable[[Any], bool] = lambda hook: False,
) -> SpikeReplay | None:
    """The spike replay of Config.spike_replay (None: off), for a model whose replay runs
    through `hooks` into records of `sampled` (step/sampled.py) by `forward_again`
    (nonfinite/replay.py's, handed in: a sibling package); not armed, and said once, in
    a process that is one rank of several or whose parameters are sharded, where a replay
    could start collectives the other ranks never join. `capsules`: the writer of a
    difference's capsule (capsule_dir set: nonfinite/check_capsule.py); `sums`: the layers'
    output sums (step/output_sums.py), installed by the caller, of the rows `names` (layers,
    then containers); `has_regions`: are modules below the root compiled on their own?
    `table` (layers.py LayerTable): the parameters whose own gradients are compared too,
    `own_hook`: is a parameter's gradient hook hookprof's (a sampled step's)?"""
    if not config.spike_replay:
        return None
    refused = SEVERAL_RANKS if with_other_ranks() else SHARDED if sharded else None
    if refused is not None:
        say("spike replay off", f"spike_replay is not armed: {refused}")
        return None

    def again(captured: Any, start: Any, backward: Callable[[Any], None] | None = None) -> Any:
        own = sampled.new_record()
        outputs: list[Any] = []
        try:
            root = model()
            assert root is not None  # (a forward was captured: the model is alive)
            forward_again(
                root, hooks, own, captured, start=start, output_into=outputs, backward=backward
            )
        finally:
            sampled.discard(own)
        return outputs[0]

    return SpikeReplay(
        limits,
        again,
        model=model,
        capsules=capsules,
        sums=sums,
        names=names,
        has_regions=has_regions,
        say=say,
        params=table.params if table is not None else (),
        param_names=table.param_names if table is not None else (),
        param_layers=table.param_layer if table is not None else (),
        own_hook=own_hook,
    )
