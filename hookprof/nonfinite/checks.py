"""The NaN/Inf checks of one step, on the training thread: what is checked, and when.

Owns: the device counters of non-finite values (`Detector`), this step's model-output check
(`OutputFlags`), a fused optimizer's GradScaler state seen in this step (`ScalerView`, and its
mask of the backward check, made once per step), the device counts of GradScaler skips and of
held-back updates, the held-back update itself (`UpdateGuard`, under on_nonfinite
"skip"/"raise"), and the forward replay (`ForwardReplay`) with the publish token of its packet.

Who made the NaN is decided on the publisher's side (publish/aggregate.py, from what these
checks send); what to do about it is `IncidentResponse`'s (incident.py). This part only
looks, holds back, replays and sends.

Called by: the `Profiler`, at the step events `StepBoundary` tells, in this order within a
step: `step_began` (a compiled model's), `replay.capture` (each training forward),
`check_output` (its end), `update_began` (with a guard or compiled forwards) /
`before_update` / `closure_*` / `update_done` (each owned optimizer), `note_loss`,
`at_step_end`, `end_update`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookprof.config import Config, Policy
from hookprof.device import transfer
from hookprof.faults import Faults
from hookprof.layers import LayerTable
from hookprof.nonfinite.capsule import Capsules
from hookprof.nonfinite.detector import Detector, loss_flag, nonfinite_flags
from hookprof.nonfinite.guard import ScalerView, SkipCounters, UpdateGuard, host_flags_of_squares
from hookprof.nonfinite.output import OutputFlags
from hookprof.nonfinite.replay import (
    CapturedForward,
    ForwardReplay,
    forward_again,
    own_weights_nonfinite,
)
from hookprof.nonfinite.traced import TracedOutputCheck
from hookprof.step.gradients import Reading
from hookprof.step.hooks import LayerHooks
from hookprof.step.record import Packet, StepRecord, pack_step


def _several_ranks() -> bool:
    """Is this process one of several ranks of torch.distributed?"""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class NonfiniteChecks:
    """The training thread's side of NaN/Inf handling for one profiler."""

    def __init__(
        self,
        model: nn.Module,
        table: LayerTable,
        config: Config,
        *,
        hooks: LayerHooks,
        publisher: Any,
        new_record: Callable[[], StepRecord],
        faults: Faults,
        say: Callable[[str, str], None],
    ):
        self._table = table
        self._hooks = hooks
        self._publisher = publisher
        self._new_record = new_record
        self._faults = faults
        self._wait = config.nonfinite_sync
        self.detector = Detector(len(table))
        self.output = OutputFlags()  # this step's output checks (the one owner)
        # a GradScaler's skips of a fused optimizer, and the updates held back on the
        # device (on_nonfinite "skip"/"raise"), are counted on the device
        self._scaler_skips = SkipCounters(config.max_skipped_steps)
        self._held_back = SkipCounters(config.max_skipped_steps)
        self.guard = (
            UpdateGuard(config.nonfinite_sync, say)
            if config.on_nonfinite in (Policy.SKIP, Policy.RAISE)
            else None
        )
        # FSDP2 / tensor parallel: re-running the forward on one rank would start all-gathers
        # the other ranks never join, so a forward NaN is localised on the following
        # (sampled) steps instead
        # the incident capsule (Config.capsule_dir): rides the replay, sent with the counters
        self.capsules = (
            None
            if config.capsule_dir is None
            else Capsules(
                config,
                faults=faults,
                say=say,
                send=lambda step, path: publisher.submit(
                    self.pack(step, None, sampled=False, capsule=path)
                ),
            )
        )
        self.replay = ForwardReplay(
            model,
            enabled=not table.has_dtensor_params,
            keep_late=self.guard is not None,
            say=say,
            witness=self.capsules,
        )
        # the output check of a compiled model, traced into its graph (traced.py)
        params = table.params
        self.traced = TracedOutputCheck(params[0].device if params else torch.device("cpu"), say)
        self._rerun_forward: CapturedForward | None = None  # this step's, for `rerun`
        self._rerun_done = False  # the re-run runs once per step
        self._replay_token = 0  # the publisher's publish_now token of the replay's packet
        self._thread: int | None = None  # the training thread (the last forward's)
        self._scaler_view: ScalerView | None = None  # a fused optimizer's GradScaler state
        self._masked: tuple[list[torch.Tensor], list[torch.Tensor]] | None = (
            None  # (squares, checked)
        )
        # the loss of the step in progress (a device tensor that needs no grad, its slot in the
        # step series' ring; or a value on the host), counted at the step's end: the
        # detector's own method, bound once (no frame of ours in front of it, every step)
        self.note_loss = self.detector.note_loss

    # ---------------- within a step ----------------

    def step_began(self) -> None:
        """A step of a compiled model begins: its RNG state, for a replay of its compiled
        forward (called only then: what the last step held was cleared at its end,
        `at_step_end`)."""
        self.traced.step_began()

    def capture_for_rerun(self, args: Any, kwargs: Any, entry_module: nn.Module | None) -> None:
        """A training forward of a step that wants a re-run begins (a sampled step with
        checks whose compiled regions hide their layers: `rerun`): its inputs kept for the
        re-run, and for a replay (the root is never held: the replay keeps the model
        weakly). Any other training forward goes to `replay.capture` alone."""
        # whatever the replay's state (it keeps nothing once its one replay ran)
        self._rerun_forward = self.replay.capture(args, kwargs, entry_module, also_when_done=True)

    def check_output(self, output: Any, *, step: int) -> None:
        """A training forward returned: one reduction of the model's output, every step,
        counted once at the step's end; a known-bad output is replayed at once (the
        parameters are still this step's)."""
        flags = self.output
        # the step's first check writes its device flag into the detector's pending slot
        # (no copy at the step's end); a second forward's is or-ed with it (OutputFlags)
        flags.add(nonfinite_flags(output, self.detector.forward_slots if flags.first else None))
        if self.traced.compiled:  # (an eager forward after compiled ones)
            self.traced.eager_forward()
        self._thread = threading.get_ident()
        # also on a checked step: its record may see no producer (a NaN made by the root's
        # own code between layers), and the replay also says reproducible or transient
        if self.replay.note_output(self.output.last, self.output.earlier):
            self.replay_forward(step)

    def check_late_loss(self, loss: Any, step: int) -> None:
        """The loss of step `step`, given after the step ended: counted at once (a loss in
        the step goes to `note_loss`)."""
        if loss is not None:
            self.detector.add_flag("loss", loss_flag(loss), step)

    def update_began(self, step: int) -> None:
        """An owned optimizer's update begins: called only where there is something to do
        (`traced.called`, or a guard: StepEvents.on_update_began asks, every step)."""
        if (
            self.traced.called
        ):  # compiled forwards ran: first, the guard judges the update with them
            self._take_compiled(step)
        if self.guard is not None:
            self.guard.begin_update()

    def scaler_of(self, optimizer: torch.optim.Optimizer) -> ScalerView | None:
        """Inside GradScaler.step with a fused optimizer, its skip is on the device: counted
        here, and the view returned (the gradient norms are unscaled with it)."""
        if not hasattr(optimizer, "grad_scale"):  # guard.by_scaler, inline: asked every step
            return None
        view = ScalerView(optimizer)
        if not view.active:
            return None
        self._scaler_view = view
        self._scaler_skips.add(view.found_inf)  # type: ignore[arg-type]  # active: has one
        return view

    def backward_ended(
        self,
        checked: Reading | None,
        output_grads: list[torch.Tensor | None],
        step: int,
    ) -> None:
        """Config.capsule_dir: a backward of step `step` ended, its gradients checked
        (`checked`, StepGradients.backward). When that check can be read without waiting
        (CPU tensors; on a device, only under nonfinite_sync) and says non-finite, the
        capsule is drafted now, before the update changes the weights (Capsules.backward)."""
        capsules = self.capsules
        if (
            checked is None
            or capsules is None
            or capsules.draft is not None
            or capsules.path is not None
        ):
            return
        parts = checked.parts
        if not all(transfer.on_host(p) for p in parts) and not self._wait:
            return  # (a wait per step on a device: only where asked for)
        if all(bool(torch.isfinite(p).all()) for p in parts):
            return
        captured, model = self.replay.captured, self.replay.model
        if captured is None or model is None or captured.updates != self.replay.updates:
            return  # (the replay's one run is over, or its forward is not this step's)
        capsules.backward(model, captured, output_grads, step)

    def before_update(
        self,
        optimizer: torch.optim.Optimizer,
        squares: Reading | None,
        step: int,
    ) -> None:
        """This step's gradients are final and its parameters not updated yet: the guard
        judges the update, then a waiting replay runs (neither changes a weight: under
        nonfinite_sync the guard's wait, for a flag copied after the output's, leaves that
        one on the host, so the training thread waits once per step, not twice)."""
        if self.guard is not None:
            parts = squares.parts if squares is not None else []
            flags = self.output.step_flags() + host_flags_of_squares(self._checked_squares(parts))
            self.guard.before_update(optimizer, self._table.params, flags)
        if self.replay.flag is not None or self.replay.kept:
            self.replay_forward(step)

    def later_update(self, optimizer: torch.optim.Optimizer) -> None:
        """A later optimizer of the step that just ended (its first optimizer's post-hook
        ended it: two optimizers, no prof.step()): held back as that step's update was."""
        if self.guard is not None:
            self.guard.hold_again(optimizer, self._table.params)

    def judges_closure(self, optimizer: torch.optim.Optimizer) -> bool:
        """skip/raise: a closure step is judged as each call of the closure returns (the
        optimizer's update reads its gradients next), unless an inner optimizer makes the
        update (its pre-hook judges)."""
        return self.guard is not None and not self.guard.delegates(optimizer)

    def closure_call(self, judged: bool) -> None:
        """The closure finds the gradients it left, and the optimizer no found_inf of an
        earlier evaluation."""
        if judged and self.guard is not None:  # (judged: by the guard)
            self.guard.after_update()

    @property
    def holding(self) -> bool:
        """An update of this step is held back (a held step keeps its bad evaluation's
        squares, for the backward check)."""
        return self.guard is not None and self.guard.holding

    def replay_if_waiting(self, step: int) -> None:
        if self.replay.flag is not None:
            self.replay_forward(step)

    def update_done(self, owned: bool) -> None:
        """An optimizer step returned (any optimizer: the guard gives back what it hid). If it
        updates this model and the guard did not hold it back, its update reached the weights
        (counted for the replay; a GradScaler skip inside a fused kernel counts too, which
        errs on the side of "not the same weights")."""
        guard = self.guard
        if owned and (guard is None or not guard.holding):  # not self.holding (one call less)
            self.replay.updates += 1  # (ForwardReplay.updated, inline: every step)
        if self.guard is not None:
            self.guard.after_update()

    def at_step_end(
        self,
        squares: Reading | None,
        step: int,
        backward: dict[torch.device, torch.Tensor] | None = None,
    ) -> None:
        """The step's backward check (once per step, however often the gradients were read:
        `squares` where the update read them, `backward` as the backwards ended, per device,
        joined by the detector) and its forward check: a step is non-finite in its forward
        once, however many forwards (siamese nets, a discriminator on real and fake, entry
        calls) and output tensors it had: one flag per device, one host bool."""
        if self.traced.called and self._take_compiled(step) and self.replay.flag is not None:
            # no optimizer hook took the compiled forwards' check
            self.replay_forward(step)
        layers = (
            []
            if squares is None
            else (
                squares.parts if self._scaler_view is None else self._checked_squares(squares.parts)
            )
        )
        if backward is not None and self._scaler_view is not None:
            # a step the scaler skips counts neither reading (ScalerView.mask): one whose
            # backward's reading alone was non-finite is not counted as dropped either (the
            # scaler's skip is the step's; the parent of this join masked the joined values only)
            backward = dict(zip(backward, self._scaler_view.mask(list(backward.values()))))
        capsules = self.capsules
        if (
            capsules is not None
            and capsules.draft is not None
            and capsules.draft.kind == "backward"
            and capsules.draft.step == step
            and all(bool(torch.isfinite(p).all()) for p in layers)
        ):
            # its gradients were dropped before any update (a GradScaler's skip, a loop's own
            # loss scaler): no incident (the update's reading is finite exactly then: the
            # detector's join), and the capsule's place is kept for one (a backward draft
            # exists only where these values are read without waiting)
            capsules.draft = None
        # the output's flags combined as they came (OutputFlags)
        self.detector.end_step(layers, self.output.take(), step, backward)
        # what this step held is cleared for the next one here, at its end, as the output's
        # flags are by take(): the next step's start has nothing to clear (one call less)
        self._rerun_forward = None
        self._rerun_done = False
        self._scaler_view = None
        self._masked = None

    def end_update(self, number: int) -> int | None:
        """Step `number` is counted: an update held back is counted once per step, however
        often acted on. Returns the updates held back on the host's word so far (None
        without a guard)."""
        if self.guard is None:
            return None
        if self.guard.unguarded:
            self.replay.unheld(number)  # its update reached the weights: no late replay
        held_on_device = self.guard.end_step()
        if held_on_device is not None:
            self._held_back.add(held_on_device)
        return self.guard.held_back

    # ---------------- what is sent ----------------

    def pack(self, step: int, record: StepRecord | None, **kwargs: Any) -> Packet:
        """A packet of step `step` carrying the device counters (and whatever `kwargs` add:
        a sampled step's record, gradients, loss, efficiency figures)."""
        return pack_step(
            step,
            record,
            self.detector.blocks(),
            counts=self._device_counts(),
            dropped_values=self.detector.dropped_blocks(),
            **kwargs,
        )

    def drain(self, steps: int, **kwargs: Any) -> None:
        """Send the non-finite counters alone (no sampled step to carry them), and whatever
        `kwargs` add (the every-step series)."""
        self._publisher.submit(self.pack(steps, None, sampled=False, **kwargs))

    def _take_compiled(self, step: int) -> bool:
        """The compiled forwards' output check since the last take, handed to the same
        readers as the eager check's; True when there was one."""
        taken = self.traced.take()
        if taken is None:
            return False
        last, any_forward, inputs = taken
        self.output.add_compiled(last, any_forward)
        self._thread = threading.get_ident()
        if inputs is not None:
            args, kwargs = inputs
            self.replay.capture(args, kwargs, rng=self.traced.rng)
            # kept for this step's re-run (statistics of a sampled step), whatever the replay's state
            self._rerun_forward = CapturedForward(None, args, kwargs, *(self.traced.rng or ()))
        if self.replay.note_output(self.output.last, self.output.earlier):
            self.replay_forward(step)
        return True

    def rerun(self, rec: StepRecord) -> StepRecord | None:
        """A sampled step of a compiled model, or of one compiled block by block: its forward
        once more, eagerly, under no_grad, with the layer checks on (activation statistics
        and non-finite flags per layer; no times: the record says where the re-run's calls
        begin), into the step's own record when it has one (the blocks' layers join the
        layers around them). Before the update: the step's own weights. Returns the record,
        None when there is no forward of this step to re-run or it failed (counted; training
        goes on)."""
        captured, self._rerun_forward = self._rerun_forward, None
        model = self.replay.model
        if (
            captured is None
            or model is None
            or self._rerun_done
            or self._table.has_dtensor_params
            or _several_ranks()
        ):
            # a forward run on one rank alone would start collectives (FSDP2, tensor parallel,
            # an all-reduce in the model's code) that the other ranks never join
            return None
        self._rerun_done = True  # (an LBFGS closure's later calls run on moved weights)
        with self._faults.contain("forward re-run", disable=False):
            own = StepRecord(rec.ref)  # recorded apart, then joined: see StepRecord.absorb_rerun
            try:
                forward_again(model, self._hooks, own, captured)
            finally:  # (what a failed re-run recorded goes back with the step's marks)
                rec.absorb_rerun(own)
            return rec
        return None

    def replay_forward(self, step: int) -> None:
        """If this step's output went non-finite on an unchecked step, replay its forward
        with the per-layer checks on, before the optimizer changes the parameters."""
        replay = self.replay
        rec = None
        try:
            if replay.flag is not None:
                rec = replay.run_if_bad(self._hooks, self._new_record, step, wait=self._wait)
            if rec is None and replay.kept:  # an earlier step's flag may have arrived
                late = replay.run_late(self._hooks, self._new_record)
                if late is not None:
                    step, rec = late
        except Exception as exc:
            # the replay (once per run) is over either way, and put back what it changed; the
            # hook or step boundary that called it goes on (a late replay runs at a step's
            # end: an exception out of here cost that step its count). Hooks stay on.
            self._faults.report("forward replay", exc, disable=False)
        refused = replay.take_refused() if replay.refused else ()
        for bad_step, why in refused:  # the first NaN is then "not replayed", and why
            self._publisher.submit(self.pack(bad_step, None, sampled=False, not_replayed=why))
        if refused and self.replay.keep_late:  # skip/raise: the policy may be waiting for it
            self._replay_token = self._publisher.publish_now()
        if rec is not None:
            weights = [("weights_bad", f) for f in own_weights_nonfinite(self._table.layers)]
            self._publisher.submit(
                self.pack(
                    step,
                    rec,
                    sampled=False,
                    extra=weights,
                    replay_moved=self.replay.moved,
                    not_replayed=self.replay.caveat,
                )
            )
            if self.replay.keep_late:  # skip/raise: the policy may be waiting for its layer
                self._replay_token = self._publisher.publish_now()

    def settle(self, step: int) -> None:
        """flush(), which may wait: the output flags the replay keeps are waited for, so a
        kept non-finite step is replayed, or said to be beyond a replay, now rather than at
        a step end that may never come (the run may be over)."""
        if threading.get_ident() != self._thread:  # the replay runs the model: its thread only
            return
        if self.replay.wait_for_flags():
            self.replay_forward(step)

    def replay_pending(self, bad_step: int) -> bool:
        """Can the forward replay still name the producer of `bad_step`'s NaN: a kept step
        up to it not looked at yet, or the replay's packet not published yet?"""
        return (
            self.replay.may_replay(bad_step) or self._publisher.published_token < self._replay_token
        )

    def _checked_squares(self, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        """The squares the backward check counts: none on a step a fused optimizer's
        GradScaler skips (masked once per step, for the guard and the detector alike)."""
        if self._scaler_view is None:
            return squares
        if self._masked is None or self._masked[0] is not squares:
            self._masked = (squares, self._scaler_view.mask(squares))
        return self._masked[1]

    def _device_counts(self) -> dict[str, list[torch.Tensor]]:
        """The device counters drained beside the non-finite ones (aggregate.fold reads them)."""
        return {"scaler_skips": self._scaler_skips.blocks(), "held_back": self._held_back.blocks()}
