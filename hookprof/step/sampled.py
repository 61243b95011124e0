"""The sampled step's life: planned, recorded, packed and sent, or released.

Owns: this step's plan (sampled? with activation checks?), its record (what the per-layer
hooks write), the per-layer hooks going in and out with it, which sampled step was last
sent to the publisher, and whether the publisher was nudged to fold it yet.

    begin(number)          plan the step; a sampled one gets a record and the layer hooks
    install_late(...)      step 1's hooks go in at its first eager forward
    nudge()                the forward's end: the publisher folds the last sampled step now
    end(number, pack)      hooks out; the record packed for its one device-to-host copy and
                           submitted (or its timer events released when the step is no sample)
    stop()                 no step boundary comes: per-layer work stops until one does

Called by: the `Profiler` on the training thread, at the boundaries `StepBoundary` tells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hookprof.device.timing import Timer
from hookprof.step.hooks import LayerHooks
from hookprof.step.plan import UNSAMPLED, StepPlan, StepPlanner
from hookprof.step.record import Packet, StepRecord


class SampledStep:
    """One profiler's sampled steps, one at a time (training thread only)."""

    def __init__(
        self,
        config: Any,
        hooks: LayerHooks,
        timer: Timer,
        publisher: Any,
        *,
        aligned: bool = False,
    ):
        # its slice of the config: sample_every, min_sample_interval_s, activation_stats,
        # activation_interval_s; `aligned`: one rank of several samples the same step numbers
        # as the others (plan.Sampler)
        self._planner = StepPlanner(
            config.sample_every,
            config.min_sample_interval_s,
            config.activation_stats,
            config.activation_interval_s,
            aligned=aligned,
        )
        self._hooks = hooks
        self._timer = timer
        self._publisher = publisher
        self.plan: StepPlan = UNSAMPLED
        self.record: StepRecord | None = None  # what a sampled step's hooks write
        self.last_sent = 0  # the number of the last sampled step sent to the publisher
        # ... and the publisher has not been nudged to fold it yet (read by the profiler at
        # every forward's end, an attribute: nudge() only when there is one to fold)
        self.unfolded = False
        # this checked step's hooks cannot see the layers inside compiled regions: its
        # statistics come from a re-run of its forward (nonfinite/checks.py `rerun`), all of
        # them, so its own calls take none (the two would disagree in order, not in value)
        self.rerun_wanted = False

    def new_record(self) -> StepRecord:
        """A record of its own (the forward replay's)."""
        return StepRecord(self._timer.start())

    def begin(
        self, number: int, now_ns: int, *, incident: bool, broken: bool, compiled: bool
    ) -> StepRecord | None:
        """Plan step `number`: sampled or not, with output checks or not; hooks in or out
        (out under torch.compile, and while a fault in them backs off: `broken`, whose step
        is still sampled for its gradient norms). Returns the step's record (None: no hooks)."""
        self.plan = self._planner.plan(number, now_ns, incident=incident)
        self.rerun_wanted = compiled and self.plan.checked  # a compiled model's statistics
        if self.plan.sampled and not compiled and not broken:
            self.record = StepRecord(self._timer.start())
            # the first step's hooks go in at its first eager forward (install_late): a model
            # compiled after attach() must never see them, or Dynamo recompiles
            self._hooks.begin(self.record, install=number > 1, activation_stats=self.plan.checked)
            self._decide_rerun()
        elif self._hooks.installs.members:  # (installed, without its call: every step)
            self._hooks.remove()
        return self.record

    def _decide_rerun(self) -> None:
        if self.plan.checked and self._hooks.hides_compiled_layers:
            self.rerun_wanted = True
            self._hooks.activation_stats_off()

    def record_by(self, make: Callable[[StepRecord], StepRecord | None]) -> None:
        """A sampled step without hooks of its own (a compiled model) gets its record from
        `make` (nonfinite/checks.py `rerun`: its forward once more, eagerly), packed with the
        step at its end; when `make` gives none, the record's timer events go back. A step
        with a record of its own (compiled regions) has `make` add to it."""
        if not self.rerun_wanted:
            return
        if self.record is not None:
            make(self.record)
            return
        record = self.new_record()
        if make(record) is None:
            self._timer.release(record.tokens())
        else:
            self.record = record

    def install_late(
        self, module: nn.Module, args: Any, own_layer: int | None, entry: bool
    ) -> None:
        """A training forward of the root begins on a sampled step whose hooks are not in
        yet (step 1): put them in now."""
        if self.record is None or self._hooks.installed or entry:
            # (an entry call's own forward was looked up before its pre-hooks ran: a wrapper
            # installed now would be missed, so step 1's layers go unrecorded)
            return
        self._hooks.install()
        self._decide_rerun()
        if own_layer is not None:
            # this call's pre-hooks were fixed before ours ran: start the root's own timing by
            # hand (its post-hook is picked up after forward, as usual)
            self._hooks.start_call(own_layer, module, args)

    def nudge(self) -> None:
        """The publisher folds the last sampled step now: its Python work then overlaps the
        backward pass, which seldom needs the GIL, not the forward, which needs it at every
        module call."""
        if self.unfolded:
            self.unfolded = False
            self._publisher.nudge()

    def end(
        self, number: int, *, broken: bool, pack: Callable[[StepRecord | None], Packet]
    ) -> bool:
        """Step `number` ends. A sampled step's hooks come out and it is packed by `pack` (its
        one device-to-host copy starts now; the publisher folds it when nudged or within
        publish_interval_s) and submitted; when the hooks failed half-way (`broken`) without
        their record, whose calls are partial: the gradient norms and counters still go.
        Returns whether the step was sampled."""
        sampled = self.plan.sampled
        if sampled:
            self._hooks.end()
            if broken:
                self.release()
            self._publisher.submit(pack(self.record))
            self.last_sent, self.unfolded = number, True
        self.record = None
        return sampled

    def stop(self) -> bool:
        """Per-layer work stops for the rest of this step (no step boundary comes). True when
        a sampled step was stopped."""
        if self.record is None:
            return False
        self._hooks.remove()
        self.release()
        self.plan = UNSAMPLED
        return True

    def discard(self, record: StepRecord) -> None:
        """A record of its own (new_record) not sent: its timer events go back to the pool."""
        self._timer.release(record.tokens())

    def release(self) -> None:
        """The record's timer events go back to the pool (a step that is no sample, detach)."""
        if self.record is not None:
            self._timer.release(self.record.tokens())
            self.record = None
