"""The life of a step as calls to the profiler's parts, in the order `StepBoundary`
(step/boundary.py) tells its events: `StepEvents` is the object whose job they are. Its
methods are the boundary's public protocol (`StepListener`); each one says, for one event
(a training forward begins, the output arrives, an update begins, the step ends, ...), what
every part does then. It holds the parts and owns no state of its own: what a step has seen
is the boundary's (`StepState`), the rest is the parts'.

Built by the Profiler once every part exists (profiler.py), and handed to the boundary's
`install`. Which part owns what: docs/architecture.md, "One owner per state".
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hookprof.compiled import compiled_regions, explain_compiled_forward
from hookprof.distributed import with_other_ranks
from hookprof.efficiency.figures import EfficiencyPart, StepEfficiency
from hookprof.faults import Faults, ThreadSupervisor, guarded
from hookprof.integrity.fingerprint import write_marks
from hookprof.integrity.replay_check import (
    COMPILED_REGIONS,
    INPUTS_EDITED,
    NO_RECORD,
    NO_UPDATE_HOOK,
    PARAMETERS_WRITTEN,
    REPLAY_FAILED,
    SEVERAL_RANKS,
    SHARDED,
    Comparison,
    ReplayCheck,
)
from hookprof.integrity.replicas import ReplicaCheck
from hookprof.integrity.spike_replay import COMPILED as SPIKE_COMPILED
from hookprof.integrity.spike_replay import SpikeReplay, spike_replay_of
from hookprof.integrity.update_replay import UpdateReplay
from hookprof.nonfinite.check_capsule import check_capsules
from hookprof.nonfinite.checks import NonfiniteChecks
from hookprof.nonfinite.incident import IncidentResponse
from hookprof.nonfinite.replay import forward_again, state_at_forward_start
from hookprof.nonfinite.update_capsule import update_capsules
from hookprof.notices import Notices
from hookprof.phases.clock import BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, OUTSIDE
from hookprof.phases.recorder import PhaseClock
from hookprof.phases.stall import StallWatch
from hookprof.publish.publisher import Publisher
from hookprof.step.backward_end import BackwardEnd
from hookprof.step.boundary import StepBoundary, no_step_notice
from hookprof.step.gradients import StepGradients, no_gradients_notice
from hookprof.step.hooks import LayerHooks, own_param_hook
from hookprof.step.output_sums import OutputSums
from hookprof.step.record import StepCounters, StepRecord, checked_sample_losses, pack_step
from hookprof.step.sampled import SampledStep
from hookprof.step.series import StepSeries
from hookprof.step.statistics import ParameterStatistics
from hookprof.step.update_statistics import UpdateStatistics


class CounterDrain:
    """Sends the device's non-finite counters, and the every-step series' rows since the
    last drain, alone (no sampled step to carry them): at flush(), detach(), a NaN the
    incident response wants named now, and every DRAIN_EVERY steps (step/series.py)."""

    def __init__(self, counters: StepCounters, nan: NonfiniteChecks, series: StepSeries):
        self._counters, self._nan, self._series = counters, nan, series

    def __call__(self) -> None:
        steps = self._counters.steps
        self._nan.drain(steps, series=self._series.take(steps))


class StepEvents:
    """What each step event does to the parts (see the module's docstring)."""

    def __init__(
        self,
        *,
        model_type: str,
        params: Sequence[torch.Tensor],
        clock: Callable[[], int],
        wall_clock: Callable[[], float],
        faults: Faults,
        notices: Notices,
        counters: StepCounters,
        series: StepSeries,
        grads: StepGradients,
        backward_end: BackwardEnd,
        hooks: LayerHooks,
        boundary: StepBoundary,
        phases: PhaseClock,
        watch: StallWatch,
        efficiency: StepEfficiency,
        publisher: Publisher,
        sampled: SampledStep,
        nan: NonfiniteChecks,
        incidents: IncidentResponse,
        supervisor: ThreadSupervisor,
        drain: CounterDrain,
        parameter_statistics: ParameterStatistics | None = None,
        update_statistics: UpdateStatistics | None = None,
        replicas: ReplicaCheck | None = None,
        replay_check: ReplayCheck | None = None,
        sharded: bool = False,
        spike_replay: SpikeReplay | None = None,
        update_replay: UpdateReplay | None = None,
    ):
        self._model_type, self._params = model_type, params
        self._clock, self._wall_clock = clock, wall_clock
        self._faults, self._notices = faults, notices
        self._counters, self._series, self._grads = counters, series, grads
        self._backward_end, self._hooks, self._boundary = backward_end, hooks, boundary
        self._phases, self._watch, self._efficiency = phases, watch, efficiency
        self._publisher, self._sampled, self._nan = publisher, sampled, nan
        self._incidents, self._supervisor, self._drain = incidents, supervisor, drain
        self._parameter_statistics = parameter_statistics or None  # (None: there are none)
        self._update_statistics = update_statistics or None  # (the same)
        # Config.sdc_check_interval_s (None: off): its schedule and the parameters'
        # fingerprint, and the replay of a check step's forward (hookprof/integrity/)
        self._replicas, self._replay_check, self._sharded = replicas, replay_check, sharded
        self._hold_on_forward = False  # a check step whose first forward has not begun
        self._spike_replay = spike_replay  # Config.spike_replay (None: off)
        self._update_replay = update_replay  # ... with update_norms: updates run again

    def begin_step(self, number: int, now_ns: int) -> None:
        """Plan step `number`: sampled or not, with output checks or not; hooks in or out."""
        boundary = self._boundary  # (latch_compiled's usual "no", inline: every step)
        if boundary.probe.seen and boundary.latch_compiled():  # Dynamo traced the root
            explain_compiled_forward(self._notices)
            self._backward_end.watch_params(self._params)  # (its output's node is in the graph)
        # an open incident samples every step (its window's end read first: one call less)
        incident = number <= self._incidents.open_until and self._incidents.open(number)
        # a check step (hookprof/integrity/) is sampled: its layers' outputs are summed
        check = self._replicas is not None and self._replicas.due(number, now_ns)
        self._hold_on_forward = check
        if self._nan.traced.compiled:  # (its RNG state: a compiled model's steps only)
            self._nan.step_began()
        self._series.begin(number, self._counters.last_seconds)
        faults = self._faults
        faults.step = number  # (the clock the layers' back-off counts in)
        record = self._sampled.begin(
            number,
            now_ns,
            incident=incident or check,
            compiled=self._boundary.compiled,
            # (layers_off's usual "on, nothing to retry or forget", inline: every step)
            broken=faults.recovering and faults.layers_off(),
        )
        self._grads.new_step(self._sampled.plan.sampled)
        if self._replay_check is not None:
            self._hooks.fingerprint_outputs = False  # (on again below for a check step)
            if check:
                self._begin_replay_check(number, record)
        if (
            record is not None or self._phases.bound
        ):  # a sampled step's phases are marked on the device too
            self._phases.bind(record)

    def on_eval_forward(self) -> None:
        if self._phases.where[1] in (DATA, OTHER):  # an evaluation between steps
            self._phases.enter(OUTSIDE, self._clock(), "eval")

    def on_forward(
        self,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        *,
        entry: bool,
        own_layer: int | None,
        now: int,
        first_step: bool,
    ) -> None:
        """A training forward of the root (or an entry call) begins."""
        if self._sampled.record is not None:  # a sampled step (step 1's hooks go in now)
            self._sampled.install_late(module, args, own_layer, entry)
        if self._sampled.rerun_wanted:  # a compiled model's checked step: kept for its re-run too
            self._nan.capture_for_rerun(args, kwargs, module if entry else None)
        else:  # (the replay's own capture, called direct: every training forward)
            self._nan.replay.capture(args, kwargs, module if entry else None)
        if self._sampled.plan.checked:
            self._hooks.note_root_inputs(args, kwargs)  # a NaN in the batch is the input's
        if self._hooks.fingerprint_outputs and self._replay_check is not None:
            self._note_check_forward(args, kwargs, module if entry else None)
        if self._hold_on_forward:
            self._hold_parameters()
        if self._spike_replay is not None:
            self._note_spike_forward(args, kwargs, module if entry else None)
        if first_step:
            self._phases.restart(now)
            self._watch.follow(threading.get_ident())
        self._phases.enter(FORWARD, now)

    def on_output(self, output: Any) -> None:
        """The root's forward returned: check its output (every step)."""
        self._phases.enter(BACKWARD, self._clock())
        self._nan.check_output(output, step=self._counters.steps + 1)
        if self._spike_replay is not None:
            self._note_spike_output(output)
        self._backward_end.watch(output)
        if self._sampled.unfolded:  # (a sampled step's, to fold)
            self._sampled.nudge()

    def backward_ended(self) -> None:
        """capsule_dir or spike_replay set: the gradients checked, then a backward NaN's
        capsule drafted, and the parameters' gradients summed for the spike replay."""
        self._grads.backward_ended()
        end = self._backward_end
        grads, end.output_grads = end.output_grads, []  # (drafted on the CPU, or not needed)
        self._nan.backward_ended(self._grads.backward, grads, self._counters.steps + 1)
        if self._spike_replay is not None:
            self._spike_backward_ended()

    def on_update_began(self, optimizer: torch.optim.Optimizer, *, final: bool) -> None:
        """An owned optimizer's update begins; `final`: the step's gradients are final and
        its parameters not updated yet (no closure to run first, not a later optimizer of an
        ended step): _before_update's work follows here, in the same call (every step)."""
        if self._replay_check is not None and self._replay_check.armed:
            self._run_replay_check()  # the step's own weights, for the last time
        if self._replicas is not None and self._replicas.holding:
            self._release_parameters()  # (before any optimizer of the step writes them)
        nan = self._nan
        if nan.traced.called or nan.guard is not None:  # (else it has nothing to do: every step)
            nan.update_began(self._counters.steps + 1)
        if self._spike_replay is not None:  # (last: the watch above has read the weights)
            self._spike_update_began()
        if self._sampled.rerun_wanted:
            self._sampled.record_by(self._nan.rerun)
        now = self._clock()
        self._phases.enter(OPTIMIZER, now)
        # the parameters before the update (a second optimizer of the step finds them taken)
        if self._sampled.plan.sampled:
            self._efficiency.before_update(now, optimizer)
            if self._update_replay is not None:
                self._update_began_again(optimizer, final)
        if final:  # _before_update, inline (one call less per step)
            self._grads.read_once(self._sampled.plan.sampled, at_update=True)
            # (scaler_of's usual "none", inline: only a fused optimizer under a GradScaler has one)
            if (
                hasattr(optimizer, "grad_scale")
                and (view := self._nan.scaler_of(optimizer)) is not None
            ):
                self._grads.unscale(view)
            self._nan.before_update(optimizer, self._grads.squares, self._counters.steps + 1)

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """This step's gradients are final and its parameters not updated yet (a closure's
        evaluation returned; without a closure on_update_began does this, inline)."""
        self._grads.read_once(self._sampled.plan.sampled, at_update=True)
        if (view := self._nan.scaler_of(optimizer)) is not None:
            self._grads.unscale(view)
        self._nan.before_update(optimizer, self._grads.squares, self._counters.steps + 1)

    def on_later_update(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer of the step an earlier optimizer ended (two optimizers, no prof.step())."""
        self._nan.later_update(optimizer)

    def closure_judged(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._nan.judges_closure(optimizer)

    def on_closure_call(self, judged: bool) -> None:
        self._nan.closure_call(judged)

    def on_back_in_optimizer(self) -> None:
        self._phases.enter(OPTIMIZER, self._clock())  # the closure returned
        self._sampled.record_by(
            self._nan.rerun
        )  # its forward ran in the closure, the update comes next

    def on_closure_returned(self, optimizer: torch.optim.Optimizer, judged: bool) -> None:
        if not judged:
            self._grads.forget()  # read once, at the step's end (.grad untouched)
            self._nan.replay_if_waiting(self._counters.steps + 1)
            return
        if not self._nan.holding:  # (a held step keeps its bad evaluation's squares)
            self._grads.forget()
        self._before_update(optimizer)

    def on_any_update_done(self, owned: bool, *, returned: bool) -> None:
        """An optimizer's update returned (any optimizer's, `owned`: this model's);
        `returned`: an owned one's that does not end the step (prof.step() will)."""
        self._nan.update_done(owned)
        if owned and self._update_replay is not None and self._update_replay.running:
            self._update_done_again()  # (a step measuring updates, spike_replay armed)
        if not owned and self._replicas is not None and self._replicas.holding:
            # another model's update inside the parameter watch's window: what came before
            # it (a GAN's clamp of this model) is another step's; the window starts again
            self._replicas.restart()
            self._hold_on_forward = True
        if returned and self._phases.progress.where[1] == OPTIMIZER:
            self._phases.enter(OTHER, self._clock())

    def note_sample_losses(self, values: Any) -> None:
        """prof.step(loss, sample_losses=...): checked (a clear error for what is not one),
        then kept for the spike replay of the step (said once where it is not armed)."""
        values = checked_sample_losses(values)
        if self._spike_replay is None:
            self._notices.say(
                "sample losses unused",
                "prof.step(sample_losses=...) is read only by the spike replay "
                "(Config.spike_replay), which is off here: they are not kept",
            )
            return
        self._keep_sample_losses(values)

    @guarded("spike replay", disable=False)
    def _keep_sample_losses(self, values: torch.Tensor) -> None:
        assert self._spike_replay is not None
        self._spike_replay.sample_losses(values)

    def on_late_loss(self, loss: Any) -> None:
        """prof.step(loss) after the optimizer hook ended the step: this adds its loss."""
        number = self._counters.steps
        self._nan.check_late_loss(loss, number)
        if self._spike_replay is not None:
            self._spike_late_loss(number, loss)
        if loss is not None:
            self._series.loss(loss, number)
        if loss is not None and self._sampled.last_sent == number:  # it was a sampled step
            # sent on its own (a copy of one value on an accelerator): this happens once,
            # when prof.step() takes over after optimizer steps ended them
            self._publisher.submit(pack_step(number, None, [], loss=loss, sampled=False))
        self._incidents.at_step_end(number)

    def on_step_end(
        self, loss: Any, *, skipped: bool, started_ns: int | None, forward_seen: bool
    ) -> tuple[int, int]:
        """The step boundary: count the step and pack a sampled one. Returns (number, now).
        `loss`: prof.step(loss)'s, checked first."""
        nan, grads = self._nan, self._grads
        if loss is not None:
            # a loss on a device is copied into its slot of the step series' ring first, and
            # checked there (float64, no grad: the same NaN/Inf, no `detach`)
            kept = self._series.loss(loss)
            nan.note_loss(loss if kept is None else kept, self._counters.steps + 1)
        replay = nan.replay
        if (
            replay.flag is not None or (replay.kept and not self._grads.read_at_update)
        ) and not skipped:
            nan.replay_forward(self._counters.steps + 1)  # no optimizer hook ran: still this step's
        now = self._clock()
        if started_ns is None:  # a first step without a forward: no phases to tell
            self._phases.restart(now)
        start = started_ns if started_ns is not None else now
        checked = backward = None
        if not skipped:
            checked, backward = grads.at_step_end(
                self._sampled.plan.sampled
            )  # (read, if no optimizer hook did)
            if grads.squares is not None and not grads.squares.seen and forward_seen:  # read: none
                self._notices.say(
                    "no gradients", no_gradients_notice(self._model_type, grads.backward)
                )
        nan.at_step_end(checked, self._counters.steps + 1, backward)
        duration_s = (now - start) * 1e-9
        number = self._counters.observe(duration_s, self._wall_clock(), skipped)
        if self._spike_replay is not None:
            self._spike_step_ended(number)
        # an update held back on the host changed no weight: like a GradScaler skip, no update
        # norm and no throughput (a fused kernel's skip on the device measures 0: efficiency.md)
        guard = nan.guard  # (nan.holding, inline)
        no_update = skipped or (guard is not None and guard.holding)
        if guard is not None:
            self._counters.set_held_back(nan.end_update(number) or 0)  # (with a guard: an int)
        self._phases.end_step(number, now)
        if self._replicas is not None and self._replicas.step == number:
            self._check_replicas(number)
        if self._replay_check is not None and self._replay_check.armed:  # no update began
            self._submit_replay(self._replay_check.refusal(number, NO_UPDATE_HOOK), ())
            self._hooks.fingerprint_outputs = False

        def pack(record: StepRecord | None) -> Any:
            # first: it frees the copies taken before the update, which a fault in what
            # follows would otherwise leave held (the next measurement would span two steps)
            layer_sums = self._update_statistics_of(no_update)
            efficiency = self._efficiency_of(number, now, duration_s, no_update)
            statistics = self._parameter_statistics  # (the parameters after the update)
            parameter_stats = () if statistics is None else statistics.take(self._report)
            packet = nan.pack(
                number,
                record,
                grad_squares=grads.squares,
                loss=loss,
                efficiency=efficiency,
                series=self._series.take(number),
                parameter_stats=parameter_stats,
                layer_sums=layer_sums,
            )
            packet.steps_at_end = self._counters.totals()
            packet.seconds = duration_s
            return packet

        if self._sampled.plan.sampled and self._sampled.end(
            number, broken=self._faults.broken, pack=pack
        ):
            self._efficiency.drop()  # what a skipped or unsent step noted and copied goes
        if self._update_replay is not None:  # (after the step's packet: its jumps judged)
            self._update_ended_again(number, no_update)
        return number, now

    def on_step_ended(self, number: int, now: int) -> None:
        if self._sampled.plan.sampled or now >= self._supervisor.due_ns:  # not every step
            self._supervisor.check(now)
        try:
            self._incidents.at_step_end(number)  # (raises NonFiniteError under "raise")
        finally:  # a loop that catches it and trains on: the next step is still planned
            if number >= self._series.due:  # the ring would be written over before a drain
                self._drain()
            self.begin_step(number + 1, now)

    def on_no_step_signal(self) -> None:
        """So many forwards without a step boundary: per-layer work stops (the record would
        grow with every call) until one comes; said once."""
        if self._sampled.stop():
            self._phases.bind(None)
        self._notices.say("no steps", no_step_notice(self._model_type))

    # ---------------- what the step's events call on ----------------

    @guarded("efficiency figures", disable=False)
    def _efficiency_of(
        self, number: int, now_ns: int, duration_s: float, skipped: bool
    ) -> EfficiencyPart | None:
        """A sampled step's FLOPs and timing (none when off, or skipped: no update, no
        throughput). A fault here costs only these figures: the step's others still go out."""
        if not self._efficiency.enabled or skipped:
            return None
        return self._efficiency.end_step(number, now_ns, duration_s)

    @guarded("efficiency update measurement", disable=False, default=())
    def _update_statistics_of(self, skipped: bool) -> list[Any]:
        """The statistics of source "update" (the weight and update norms and ratio among
        them) when this step's update was measured, its copies freed (a skipped step
        changed no weight: none, and efficiency.drop() frees them)."""
        measured = self._efficiency.measured_update()
        if measured is None or skipped:
            return []
        if self._update_statistics is None:
            measured.drop()
            return []
        return self._update_statistics.take(measured, self._report)

    def _begin_replay_check(self, number: int, record: StepRecord | None) -> None:
        """A check step: its layers' outputs summed, to be compared with a replay's."""
        refused = (
            NO_RECORD
            if record is None
            else SEVERAL_RANKS
            if with_other_ranks()
            else SHARDED
            if self._sharded
            else COMPILED_REGIONS
            if self._hooks.hides_compiled_layers
            else None
        )
        assert self._replay_check is not None
        self._replay_check.begin(number, refused)
        self._hooks.fingerprint_outputs = refused is None

    @guarded("replay check", disable=False)
    def _note_check_forward(self, args: Any, kwargs: Any, entry: nn.Module | None) -> None:
        """A training forward of a check step begins: the first is kept to be replayed, with
        the modules' state as it begins; a second refuses the step, and no more is summed."""
        check, model = self._replay_check, self._nan.replay.model
        assert check is not None
        if check.wants_forward and model is not None:
            captured = self._nan.replay.capture(args, kwargs, entry, also_when_done=True)
            marks = write_marks(list(model.parameters()))
            check.note_forward(captured, state_at_forward_start(model), marks)
        else:
            check.note_forward(None, None)
        if check.refused is not None or not check.armed:
            self._hooks.fingerprint_outputs = False

    @guarded("replay check", disable=False)
    def _run_replay_check(self) -> None:
        """The check step's forward once more, before its update, eagerly and under no_grad
        (nonfinite/replay.py `forward_again`: its inputs, RNG state and autocast; the model's
        buffers put back), its layers' outputs compared with the step's own on the device."""
        check = self._replay_check
        assert check is not None
        marks = check.marks
        step, captured, start = check.take()
        record, model = self._sampled.record, self._nan.replay.model
        try:
            if check.refused is not None or record is None or model is None:
                self._submit_replay(check.refusal(step, check.refused or NO_RECORD), ())
                return
            if captured.changed_in_place():
                self._submit_replay(check.refusal(step, INPUTS_EDITED), ())
                return
            if marks != write_marks(list(model.parameters())):
                self._submit_replay(check.refusal(step, PARAMETERS_WRITTEN), ())
                return
            own = self._sampled.new_record()
            try:
                forward_again(model, self._hooks, own, captured, start=start)
                comparison, parts = check.compare(step, record, own)
                if check.capsules is not None:  # capsule_dir: a mismatch's capsule, now
                    comparison = check.keep_mismatch(
                        comparison, parts, model, captured, start, record, own
                    )
            except Exception:
                self._submit_replay(check.refusal(step, REPLAY_FAILED), ())
                raise  # (counted by the guard; training goes on)
            finally:
                self._sampled.discard(own)
            self._submit_replay(comparison, parts)
        finally:  # the step's later forwards (a GAN's other model, a closure's) are not summed
            self._hooks.fingerprint_outputs = False
            if record is not None:
                record.fingerprints = []

    def _submit_replay(self, comparison: Comparison, parts: Any) -> None:
        self._publisher.submit(
            pack_step(comparison.step, None, [], sampled=False, replay_check=(comparison, parts))
        )

    @guarded("spike replay", disable=False)
    def _note_spike_forward(self, args: Any, kwargs: Any, entry: nn.Module | None) -> None:
        """A training forward begins: the spike replay keeps the step's first (its inputs and
        RNG, the modules' state), integrity/spike_replay.py."""
        replay, model = self._nan.replay, self._nan.replay.model
        assert self._spike_replay is not None and model is not None
        self._spike_replay.forward_began(
            self._counters.steps + 1,
            lambda: replay.capture(args, kwargs, entry, also_when_done=True),
            lambda: state_at_forward_start(model),
            SPIKE_COMPILED if self._boundary.compiled else None,
        )

    @guarded("spike replay", disable=False)
    def _spike_backward_ended(self) -> None:
        """The parameters' gradients summed as the backward left them (spike_replay.py)."""
        assert self._spike_replay is not None
        self._spike_replay.backward_ended()

    @guarded("spike replay", disable=False)
    def _note_spike_output(self, output: Any) -> None:
        assert self._spike_replay is not None
        self._spike_replay.output(output)

    @guarded("spike replay", disable=False)
    def _spike_update_began(self) -> None:
        """The last step's gate read, its replay run if it tripped (sent on its own), and this
        step's parameters kept before its update."""
        assert self._spike_replay is not None
        self._submit_spike(self._spike_replay.update_began(self._counters.steps + 1))

    def _submit_spike(self, sent: Any) -> None:
        if sent is not None:  # a spike's replay: its comparison and flags, on their own
            self._publisher.submit(
                pack_step(sent[0].step, None, [], sampled=False, replay_check=sent)
            )

    @guarded("spike replay", disable=False)
    def _spike_step_ended(self, number: int) -> None:
        assert self._spike_replay is not None
        self._submit_spike(self._spike_replay.step_ended(number, *self._series.current_values()))

    @guarded("update replay", disable=False)
    def _update_began_again(self, optimizer: torch.optim.Optimizer, final: bool) -> None:
        """A step that measures updates: the turn's parameters' update run a second time, by
        a shadow of `optimizer` (integrity/update_replay.py)."""
        measured = self._efficiency.measured_update()
        if measured is not None:
            assert self._update_replay is not None
            self._update_replay.update_began(
                self._counters.steps + 1, optimizer, measured.turn, final
            )

    @guarded("update replay", disable=False)
    def _update_done_again(self) -> None:
        assert self._update_replay is not None
        self._update_replay.update_done()

    @guarded("update replay", disable=False)
    def _update_ended_again(self, number: int, no_update: bool) -> None:
        """The step's updates against their second run, sent on their own (none: no update
        was run again, or the step's update did not happen)."""
        assert self._update_replay is not None
        # (the update norms' sums around this step's update, if measured: the jump's gate
        # reads them; taken every step, so none is read at a later step's end)
        around = self._update_statistics.last_around() if self._update_statistics else None
        if no_update:
            self._update_replay.drop()
        else:
            for sent in self._update_replay.step_ended(number, around):
                self._submit_spike(sent)
        for sent in self._update_replay.poll():  # (capsule_dir: an earlier step's, decided)
            self._submit_spike(sent)

    def drain(self) -> None:
        """flush() or detach(), which wait for the device anyway: the measured updates whose
        capsules wait for their values decided now, then the counters of the steps since
        the last sample sent."""
        if self._update_replay is not None:
            self._settle_updates()
        self._drain()

    @guarded("update replay", disable=False)
    def _settle_updates(self) -> None:
        """The measured steps whose capsules wait for their values decided (waited for),
        their comparisons sent (integrity/update_replay.py)."""
        assert self._update_replay is not None
        for sent in self._update_replay.settle():
            self._submit_spike(sent)

    @guarded("spike replay", disable=False)
    def _spike_late_loss(self, number: int, loss: Any) -> None:
        assert self._spike_replay is not None
        self._spike_replay.late_loss(number, loss)

    @guarded("replica check", disable=False)
    def _hold_parameters(self) -> None:
        """A check step's first training forward begins: its parameters must stand still
        until its update (integrity/replicas.py)."""
        self._hold_on_forward = False
        assert self._replicas is not None
        self._replicas.hold()

    @guarded("replica check", disable=False)
    def _release_parameters(self) -> None:
        assert self._replicas is not None
        self._replicas.release()

    @guarded("replica check", disable=False)
    def _check_replicas(self, number: int) -> None:
        """A check step (integrity/replicas.py): the parameters' fingerprint after this
        step's update, with what changed between its forward and its update, sent on its own
        (a drain's packet, nothing read back)."""
        assert self._replicas is not None
        fingerprint = self._replicas.take()
        changes = self._replicas.changes
        self._publisher.submit(
            pack_step(number, None, [], sampled=False, fingerprint=fingerprint, changes=changes)
        )

    def _report(self, part: str, exc: BaseException) -> None:
        """A statistic of the user's failed: counted and logged; nothing switches off."""
        self._faults.report(part, exc, disable=False)

    @contextlib.contextmanager
    def output_sums(self, compiled: bool) -> Iterator[None]:
        """The spike replay's per-layer output sums in place for the block (attach to detach;
        under the sampled steps' wrappers, which `release` takes out first). None on a model
        compiled before attach: a wrapper put in now would recompile it, and its steps are
        not replayed."""
        sums = self._spike_replay.sums if self._spike_replay is not None else None
        if sums is None or compiled:
            yield
            return
        with sums.installed():
            yield

    def release(self) -> None:
        """At detach: layer hooks out; a sampled step that never ended gives its events back."""
        self._supervisor.close()  # runs before the threads stop: none restarts after detach
        self._hooks.remove()
        self._efficiency.drop()
        self._sampled.release()
        if self._update_replay is not None:
            self._update_replay.release()


def replays_of(
    config: Any,
    table: Any,
    name: str,
    rank: int,
    faults: Faults,
    say: Callable[[str, str], None],
    nan: NonfiniteChecks,
    hooks: LayerHooks,
    sampled: SampledStep,
    publisher: Publisher,
) -> dict[str, Any]:
    """StepEvents' replay check (Config.sdc_check_interval_s) and spike replay
    (Config.spike_replay) of a model, None where off, each with the writer of its
    differences' capsules where capsule_dir is set (hookprof/integrity/, nonfinite/)."""
    capsules = functools.partial(check_capsules, config, name, rank, faults, say)
    root = nan.replay.model
    sums = OutputSums(table, root, faults) if config.spike_replay and root is not None else None
    spike_replay = spike_replay_of(
        config,
        lambda: nan.replay.model,
        hooks,
        sampled,
        publisher.spike_gate_limits,
        forward_again,
        sharded=table.has_dtensor_params,
        say=say,
        capsules=capsules("spike replay"),
        sums=sums,
        names=[table.row_name(row) for row in range(table.rows)],
        has_regions=lambda: bool(compiled_regions(table)[0]),
        table=table,
        own_hook=own_param_hook,
    )
    return {
        "replay_check": ReplayCheck.of(config, table.names, capsules()),
        "spike_replay": spike_replay,
        # an update ratio jump's verdict: measured updates run again (update_replay.py)
        "update_replay": UpdateReplay(
            table.params,
            table.param_names,
            capsules=update_capsules(config, name, rank, faults, say),
            layer_names=table.names,
            limits=publisher.update_ratio_limits,
            gate=spike_replay.gate_also,
        )
        if spike_replay is not None and config.update_norms
        else None,
    }
