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
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from hookprof.integrity.spike_replay import SpikeComparison
from hookprof.step.dispatch import others_around_update
from hookprof.tensors import local_bits

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


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class UpdateReplay:
    """The training thread's side: `update_began` on each optimizer's update of a step that
    measures updates, `step_ended` at its end (see the module's docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str]):
        self._params = params  # the layer table's parameters, by position
        self._names = names
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
                hyper = {key: _copy(v) for key, v in group.items() if key != "params"}
                shadow_groups.append({**hyper, "params": copies})
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
        with torch.no_grad():
            for position, copy in running:
                ours = local_bits(self._params[position])
                self._flags.append((position, (ours != local_bits(copy)).any()))

    def step_ended(self, step: int) -> tuple[SpikeComparison, list[torch.Tensor]] | None:
        """Step `step` ended, its update done: the comparison and its device flags ("this
        parameter's bits differ from the second run's"), to send; None when the step ran
        no update again."""
        if self._step != step:
            return None
        if self.running:  # (no post-hook came: an update that raised, half done)
            self.running, self._refused = [], self._refused or UNFINISHED
        flags, refused = self._flags, self._refused
        self._step, self._flags, self._refused = None, [], None
        if not flags:  # (with some run again, those are compared, the others left out)
            return SpikeComparison(step, refused=refused or NO_OPTIMIZER, update_from=0), []
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for k, (_, flag) in enumerate(flags):
            by_device.setdefault(flag.device, []).append((k, flag))
        order = tuple(k for group in by_device.values() for k, _ in group)
        parts = [
            torch.stack([flag for _, flag in group]).to(torch.float64)
            for group in by_device.values()
        ]
        names = tuple(self._names[position] for position, _ in flags)
        return (
            SpikeComparison(
                step,
                deterministic=self._deterministic,
                layers=names,
                order=order,
                update_from=0,
            ),
            parts,
        )

    def drop(self) -> None:
        """The step's update did not happen (a skipped step) or was held back: nothing to
        compare."""
        self._step, self._flags, self._refused, self.running = None, [], None, []
