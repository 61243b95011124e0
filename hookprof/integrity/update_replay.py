"""An update ratio jump's verdict (Config.spike_replay, issue 43 item 2): did the optimizer
compute that update, or did the machine?

A jump in a layer's update-to-weight ratio (publish/spikes.py `update_ratio_jump`) is judged
on the sampled steps that measure that layer's update (efficiency/updates.py: the layers
take turns, about once per `update_norm_interval_s`). What made the update is the
optimizer's step, from the step's weights, gradients, the optimizer's state and its
hyperparameters; a replay of the forward and backward says nothing about it. So on each
step that measures updates, while the spike replay is armed, this runs the update a second
time, as that step's update begins, for the parameters of the layers whose turn it is:

- copies of those parameters, their gradients, their optimizer state (Adam's two moments
  and step count) and their parameter group's hyperparameters (the learning rate as it is
  then: a scheduler may change it before the step ends);
- a shadow of the optimizer (the same class, its attributes: a fused optimizer's
  GradScaler `grad_scale` and `found_inf` among them) holding the copies alone, stepped
  through the class's own `step`, past every optimizer hook (hookprof's and other tools');
- as the real update returns (the optimizer's post-hook, before the loop can write the
  parameters again: a clamp after `step()`), each parameter's bits against the shadow's, on
  the device; at the step's end the flags ride a packet of their own to the publisher.

The bits are the same when the optimizer, given what the step gave it, makes that update
again: a jump then comes from what it was given, the gradients (the data) or the loop's
hyperparameters: *reproduced*. Bits that differ mean the device computed the update
differently the second time: *not reproduced*, naming the first parameter (in the layers'
turn order) and phase "update". A run's first rechecks calibrate: until one reproduces,
differences are not blamed on the machine (an optimizer whose kernels are not bit-stable).
The publisher counts a recheck (hookprof_spike_replays_total) when a jump starts on its step,
and whenever it differs after calibration: a device that computes an update differently
twice is worth a page whether or not the ratio jumped.

Not rechecked, with the reason said: an update that runs a closure (its gradients are not
final as it begins), an optimizer that is not one of torch.optim's own (a hand-written one
may keep state outside `optimizer.state`, which the shadow would share and write), one with
step hooks of its own (torch runs them between hookprof's, where they may write the
gradients or the parameters), or under another tool's global step hooks that torch runs
between hookprof's (step/dispatch.py `others_around_update`); an update that raised (no
post-hook came: its parameters may be updated half-way); a
parameter of the turn that no optimizer of the step runs again is left out, the others
compared. Training is unchanged
bit for bit: the shadow writes only its own copies.

With capsule_dir set (`capsules`), what each update began from is copied apart as well, and
held until the step's flags, its layers' update and weight squares and both runs' bit sums
reach the host (at a later step's end, never waited for while fewer than PENDING_MOST steps
are pending, and at flush() and detach(), which wait for the device anyway): a step whose
update differed (once calibrated) or whose layer passed the jump rule's current limit gets
its capsule (nonfinite/update_capsule.py), for `hookprof replay`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hookprof.device import transfer
from hookprof.integrity.spike_replay import SpikeComparison
from hookprof.step.dispatch import others_around_update
from hookprof.step.jump_events import JumpEvents
from hookprof.tensors import bits_sum, local_bits

CLOSURE = (
    "the update ran a closure, or came after its step's end (its gradients were not final "
    "as it began)"
)
HAND_WRITTEN = (
    "the optimizer is not one of torch.optim's (its state may live outside optimizer.state, "
    "which a second run would share)"
)
STEP_HOOKS = (
    "the optimizer has step hooks of its own (torch runs them after hookprof's pre-hook and "
    "before its post-hook: they may write the gradients or the parameters)"
)
GLOBAL_HOOKS = (
    "another tool's global optimizer step hooks run between hookprof's pre-hook and its "
    "post-hook (torch.optim.optimizer.register_optimizer_step_pre_hook after hookprof's, or "
    "register_optimizer_step_post_hook before it): they may write the gradients or the "
    "parameters"
)
UNFINISHED = (
    "the update did not return through the optimizer's post-hook (it raised, or a step hook "
    "before hookprof's did): its parameters may be updated half-way"
)
NO_OPTIMIZER = "no optimizer of the step updated the measured layers' parameters"
# measured steps whose capsules may wait for their values to reach the host (capsule_dir)
PENDING_MOST = 4
_NO_LIMITS = (math.inf, math.inf)  # a layer not judged yet (no gate, no jump)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class UpdateReplay:
    """The training thread's side: `update_began` on each optimizer's update of a step that
    measures updates, `step_ended` at its end (see the module's docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        capsules: Any = None,
        layer_names: Sequence[str] = (),
        limits: Callable[[], Mapping[str, tuple[float, float]]] | None = None,
        gate: Callable[[int, torch.Tensor], None] | None = None,
    ):
        self._params = params  # the layer table's parameters, by position
        self._names = names
        # capsule_dir set: an update's capsule (nonfinite/update_capsule.py UpdateCapsules);
        # the layers' names and the rule's current limits per layer (`limits`: publish/
        # spikes.py layer_limits), for the gate that says a jump may have begun
        self._capsules = capsules
        self._layer_names = layer_names
        self._limits = limits
        # the spike replay's gate (spike_replay.py `gate_also`): a step whose layer's ratio
        # may be a jump has its forward and backward replayed too
        self._gate = gate
        # what each update of the step began from, kept for its capsule (capsules only)
        self._kept: list[dict[str, Any]] = []
        # with capsules, per parameter compared: (position, the bit sums of the step's update
        # and of the second run's), on the device
        self._sums: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        # measured steps waiting for their flags to reach the host before their capsules
        # are decided (CUDA: read at a later step's end, without waiting), oldest first; the
        # oldest is waited for only when PENDING_MOST are (a device that many measurements
        # behind the host), which bounds the copies held
        self._pending: collections.deque[_Pending] = collections.deque()
        self._trusted = False  # a second run has reproduced in this run (capsules only)
        # the layers whose jump's event goes on, as the rule has them (publish/spikes.py
        # observe_update_ratios: while one goes on, no step is a jump's start), kept by the
        # rule's own code (capsules only). An approximation of the rule's: it judges only the
        # steps whose capsule is decided (not those refused, run by no optimizer of the
        # model's, or dropped by a fault in settle()), against the publisher's limits as of
        # its latest fold, which may be a few measurements behind or ahead of the step's
        # (`layer_limits`); it counts every measured step, where the rule counts those it
        # folds with a layer of weight above 0. A difference means a jump's capsule missing,
        # or one more written, never a jump counted or hidden.
        self._events = JumpEvents()
        self._measurements = 0  # the steps whose updates were measured, so far
        self._step: int | None = None  # the step whose updates are run again
        self._refused: str | None = None
        # torch's deterministic algorithms on as the step's first update was run again (the
        # mismatch's `deterministic` label: with them on, a difference is the device's)
        self._deterministic = False
        # (parameter position, the shadow's copy after its update) of the update running
        self.running: list[tuple[int, torch.Tensor]] = []
        # (parameter position, flag "its bits differ from the second run's"), in turn order
        self._flags: list[tuple[int, torch.Tensor]] = []

    def update_began(
        self, step: int, optimizer: torch.optim.Optimizer, turn: Sequence[int], final: bool
    ) -> None:
        """`optimizer`'s update of step `step` begins; `turn`: the positions of the
        parameters whose update the step measures (efficiency/updates.py); `final`: its
        gradients are final (no closure runs first)."""
        if self._step != step:
            self._step, self._refused, self._flags, self.running = step, None, [], []
            self._kept, self._sums = [], []
            self._deterministic = torch.are_deterministic_algorithms_enabled()
        done = {k for k, _ in self._flags}
        wanted = {id(self._params[k]): k for k in turn if k not in done}
        groups = [
            (group, [p for p in group["params"] if id(p) in wanted])
            for group in optimizer.param_groups
        ]
        if not any(mine for _, mine in groups):
            return  # (another optimizer's parameters: a GAN's generator and discriminator)
        if not final:
            self._refused = self._refused or CLOSURE
            return
        if not type(optimizer).__module__.startswith("torch.optim"):
            self._refused = self._refused or HAND_WRITTEN
            return
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            self._refused = self._refused or STEP_HOOKS
            return
        if others_around_update():
            self._refused = self._refused or GLOBAL_HOOKS
            return
        shadow_groups: list[dict[str, Any]] = []
        shadow_state: collections.defaultdict[torch.Tensor, dict[str, Any]]
        shadow_state = collections.defaultdict(dict)
        kept: list[tuple[int, torch.Tensor]] = []
        # (capsules: the update's inputs, copied apart from the shadow's, which it steps)
        keep = self._capsules is not None and not any(
            hasattr(p, "to_local") for _, mine in groups for p in mine
        )
        inputs: dict[str, Any] = {"optimizer": optimizer, "groups": [], "params": []}
        with torch.no_grad():
            for group, mine in groups:
                if not mine:
                    continue
                copies = []
                for p in mine:
                    copy = p.detach().clone()
                    if p.grad is not None:
                        copy.grad = p.grad.detach().clone()
                    state = optimizer.state.get(p)
                    if state:
                        shadow_state[copy] = {key: _copy(v) for key, v in state.items()}
                    copies.append(copy)
                    kept.append((wanted[id(p)], copy))
                    if keep:
                        inputs["params"].append(
                            (
                                wanted[id(p)],
                                copy.clone(),
                                None if copy.grad is None else copy.grad.clone(),
                                {key: _copy(v) for key, v in shadow_state[copy].items()},
                            )
                        )
                hyper = {key: _copy(v) for key, v in group.items() if key != "params"}
                shadow_groups.append({**hyper, "params": copies})
                if keep:  # (the optimizer's own keys: a loop's own objects in a group, which
                    # the update never reads, may not pickle, or not load in another process)
                    hyper_kept = {
                        key: _copy(v) for key, v in hyper.items() if key in optimizer.defaults
                    }
                    inputs["groups"].append((hyper_kept, [wanted[id(p)] for p in mine]))
            if keep:
                # (a fused optimizer's GradScaler values, set on it for this step)
                inputs["attributes"] = {
                    key: _copy(value)
                    for key, value in optimizer.__dict__.items()
                    if key in ("grad_scale", "found_inf") and isinstance(value, torch.Tensor)
                }
                self._kept.append(inputs)
            shadow = object.__new__(type(optimizer))
            shadow.__dict__.update(optimizer.__dict__)
            shadow.__dict__.update(
                param_groups=shadow_groups,
                state=shadow_state,
                _optimizer_step_pre_hooks=collections.OrderedDict(),
                _optimizer_step_post_hooks=collections.OrderedDict(),
            )
            step_of_class = type(optimizer).step
            # the class's step without torch's hook wrapper (Optimizer.profile_hook_step):
            # no optimizer hook of anyone's sees the shadow
            getattr(step_of_class, "__wrapped__", step_of_class)(shadow)
        self.running = kept

    def update_done(self) -> None:
        """The update that began last returned: its parameters' bits against the second
        run's, on the device; the copies freed."""
        running, self.running = self.running, []
        kept = {k for inputs in self._kept for k, *_ in inputs["params"]}
        with torch.no_grad():
            for position, copy in running:
                ours = local_bits(self._params[position])
                self._flags.append((position, (ours != local_bits(copy)).any()))
                if position in kept:  # (capsules: both runs' bit sums)
                    self._sums.append((position, bits_sum(ours), bits_sum(copy)))

    def step_ended(
        self, step: int, around: Any = None
    ) -> list[tuple[SpikeComparison, list[torch.Tensor]]]:
        """Step `step` ended, its update done: the comparisons to send, each with its device
        flags ("this parameter's bits differ from the second run's"): this step's (none when
        it ran no update again); with capsules, this one's once its values reach the host,
        with those of earlier ones that have since (`poll`; the oldest waited for only when
        PENDING_MOST are pending). `around`: the step's update and weight squares per layer,
        as the update norms measured them (step/update_statistics.py AroundUpdate; None:
        not measured), which the jump's gate and the capsule read (the capsule: on the
        flags' device only)."""
        sent: list[tuple[SpikeComparison, list[torch.Tensor]]] = []
        if self._step != step:
            return sent
        if self.running:  # (no post-hook came: an update that raised, half done)
            self.running, self._refused = [], self._refused or UNFINISHED
        flags, refused, kept, sums = self._flags, self._refused, self._kept, self._sums
        self._step, self._flags, self._refused, self._kept, self._sums = None, [], None, [], []
        figures = _per_layer(around)
        if figures is not None:
            # (counted whether or not this step's capsule is decided, as the rule counts the
            # measurements it folds: the mirror's events expire by about the same count)
            self._measurements += 1
            if self._gate is not None:
                self._gate_step(step, *figures)
        if not flags:  # (with some run again, those are compared, the others left out)
            sent.append((SpikeComparison(step, refused=refused or NO_OPTIMIZER, update_from=0), []))
            return sent
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for k, (_, flag) in enumerate(flags):
            by_device.setdefault(flag.device, []).append((k, flag))
        order = tuple(k for group in by_device.values() for k, _ in group)
        parts = [
            torch.stack([flag for _, flag in group]).to(torch.float64)
            for group in by_device.values()
        ]
        names = tuple(self._names[position] for position, _ in flags)
        comparison = SpikeComparison(
            step, deterministic=self._deterministic, layers=names, order=order, update_from=0
        )
        positions = [p for p, _ in flags]
        if (
            kept
            and refused is None
            and figures is not None
            and [p for p, *_ in sums] == positions
            and len(by_device) == 1
            and figures[1].device == parts[0].device
        ):  # (capsules: decided once the flags and squares reach the host)
            layers, update2, weight2 = figures
            with torch.no_grad():
                bits = torch.stack([torch.stack(m[1:]) for m in sums])
            while len(self._pending) >= PENDING_MOST:
                sent += self._decide(wait=True)
            self._pending.append(
                _Pending(
                    comparison,
                    parts,
                    kept,
                    positions,
                    sorted(layers),
                    transfer.peek(torch.cat([parts[0], update2, weight2])),
                    transfer.peek(bits),
                    self._measurements,
                )
            )
            return sent + self.poll()
        sent.append((comparison, parts))
        return sent

    def _gate_step(
        self, step: int, layers: frozenset[int], update: torch.Tensor, weight: torch.Tensor
    ) -> None:
        """The jump's gate of step `step`, on the device: does any measured layer's update
        ratio pass half the rule's threshold and margin (its forward and backward are then
        replayed)? `update`, `weight`: every layer's update and weight squares (`layers`:
        those measured). A few ops whatever the model; none until a measured layer has a
        limit (publish/spikes.py `layer_limits`). Its second flag, "past the rule's own
        limit" (the spike replay writes the batch's capsule of a spike's first step), stays
        false: a jump's capsule is the update's (its gradients are in it), and the spike
        replay cannot tell a jump's first step from the next measurement of one going on
        (found by review: a batch's capsule per measured step while a jump lasted)."""
        limits = self._limits() if self._limits is not None else {}
        found = [
            limits.get(name, _NO_LIMITS) if k in layers else _NO_LIMITS
            for k, name in enumerate(self._layer_names)
        ]
        if not any(math.isfinite(gate) for gate, _ in found):
            return
        with torch.no_grad():
            # (squared limits: an update square above limit² x the weight square; a layer
            # without one, inf: inf x 0 is NaN, and nothing is above NaN or inf; a weight of
            # 0, no judgement, as the rule's)
            bounds = transfer.floats_to_device([g * g for g, _ in found], update.device)
            tripped = ((update > bounds * weight) & (weight > 0)).any()
            over = torch.stack([tripped, torch.zeros_like(tripped)])
        assert self._gate is not None
        self._gate(step, over)

    def poll(self) -> list[tuple[SpikeComparison, list[torch.Tensor]]]:
        """A step's end: the earlier measured steps whose flags have reached the host since,
        oldest first, decided and sent (capsules only); never waits."""
        sent: list[tuple[SpikeComparison, list[torch.Tensor]]] = []
        while self._pending:
            decided = self._decide(wait=False)
            if not decided:
                break
            sent += decided
        return sent

    def settle(self) -> Iterator[tuple[SpikeComparison, list[torch.Tensor]]]:
        """flush() or detach(), which wait for the device anyway: every pending step
        decided, its values waited for, its comparison given as it is decided (one decided
        before a fault is sent all the same) and its copies freed."""
        try:
            while self._pending:
                yield from self._decide(wait=True)
        finally:
            self._pending.clear()  # (a fault: the rest not decided, their copies freed)

    def _decide(self, wait: bool) -> list[tuple[SpikeComparison, list[torch.Tensor]]]:
        """The oldest pending step's capsule, when its update differed from the second run's
        or a layer's update ratio passed the rule's limit (a jump may have begun: the
        publisher judges it), written; its comparison, with the capsule's path, to send."""
        pending = self._pending[0]
        if not wait and not (
            transfer.is_ready(pending.values.ready) and transfer.is_ready(pending.sums.ready)
        ):
            return []
        self._pending.popleft()
        if wait:  # note: a CPU-GPU sync point (PENDING_MOST pending; flush(), detach())
            transfer.wait_ready(pending.values.ready)
            transfer.wait_ready(pending.sums.ready)
        n, layers = len(pending.positions), len(self._layer_names)
        values = pending.values.host.tolist()
        flags, updates, weights = values[:n], values[n : n + layers], values[n + layers :]
        sums = pending.sums.host.tolist()
        first = next((k for k, flag in enumerate(flags) if flag), None)
        by_layer = {layer: (updates[layer], weights[layer]) for layer in pending.layers}
        limits = self._limits() if self._limits is not None else {}
        jumped = []
        # (as the rule: any layer's event going on means no jump begins)
        ongoing = self._events.next_measurement(pending.measurement)
        for layer, (update, weight) in by_layer.items():
            if not weight > 0:
                continue  # (not among the rule's ratios: no appearance)
            name = self._layer_names[layer]
            ratio = math.sqrt(update / weight)
            if not math.isfinite(ratio) or ratio == 0:
                self._events.appeared(name, kept=False)  # (the rule's: no judgement)
                continue
            going, limit = limits.get(name, _NO_LIMITS)
            if ratio > limit:
                jumped.append((name, ratio, limit))
            if name in limits:  # (the rule judges from MIN_LAYER_HISTORY ratios on)
                self._events.judged(name, ratio > limit, ratio > going)
            self._events.appeared(name, kept=True)
        if ongoing:  # (an event goes on: the rule counts no jump at this step)
            jumped = []
        comparison = pending.comparison
        # (the calibration, as the publisher's: until a second run has reproduced, a
        # difference is an optimizer whose kernels are not bit-stable, and no capsule's; a
        # jump's capsule before then does not blame the machine either)
        self._trusted = self._trusted or first is None
        uncalibrated = first is not None and not self._trusted
        if uncalibrated:
            first = None
        if first is not None or jumped:
            capsule = self._capsules.keep(
                step=comparison.step,
                kept=pending.kept,
                compared=[
                    (p, self._names[p], ours, theirs)
                    for p, (ours, theirs) in zip(pending.positions, sums)
                ],
                first=first,
                jumped=jumped,
                deterministic=comparison.deterministic,
                uncalibrated=uncalibrated,
            )
            comparison = dataclasses.replace(comparison, capsule=capsule)
        return [(comparison, pending.parts)]

    def drop(self) -> None:
        """The step's update did not happen (a skipped step) or was held back: nothing to
        compare."""
        self._step, self._flags, self._refused, self.running = None, [], None, []
        self._kept, self._sums = [], []

    def release(self) -> None:
        """detach(): nothing is held past it (the copies of pending steps too)."""
        self.drop()
        self._pending.clear()


def _per_layer(around: Any) -> tuple[frozenset[int], torch.Tensor, torch.Tensor] | None:
    """(the layers measured, every layer's update squares, every layer's weight squares),
    on one device, from the update norms' sums around the update (None: not measured). A
    model on several devices has a part per device: added up on the first part's device
    (a vector of one value per layer each; a GPU's copy to another does not wait)."""
    if around is None:
        return None
    updates, weights = around.update_squares(), around.weight_squares()
    if not updates.parts or not weights.parts:
        return None
    device = updates.parts[0].device
    with torch.no_grad():
        update, weight = (
            functools.reduce(torch.add, (p.to(device, non_blocking=True) for p in parts))
            for parts in (updates.parts, weights.parts)
        )
    return updates.layers, update, weight


@dataclasses.dataclass(slots=True)
class _Pending:
    """A measured step's comparison whose capsule waits for its values to reach the host."""

    comparison: SpikeComparison
    parts: list[torch.Tensor]
    kept: list[dict[str, Any]]  # what each update began from (update_began)
    positions: list[int]  # the parameters compared, in the flags' order
    layers: list[int]  # the layers whose update was measured
    # the flags, then every layer's update², then every layer's weight² (all its parameters)
    values: transfer.Copy
    sums: transfer.Copy  # (the step's, the second run's) bit sums per parameter
    measurement: int  # which measurement of the model's updates it was (the jump's events)
