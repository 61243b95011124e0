"""`attach()` and the Profiler: hookprof's parts composed for one model.

Read top to bottom: `attach`; the construction (each part takes its slice of the config and
its collaborators; what each start returns goes on one teardown stack); the public methods;
the life of a step as calls to its parts, in the order `StepBoundary` (step/boundary.py)
tells its events; detach. Which part owns what: docs/architecture.md, "One owner per state".
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from hookprof import live
from hookprof.compiled import (
    explain_attached_after_compile,
    explain_compiled_forward,
    unwrap_compiled,
)
from hookprof.config import Config, env_disabled
from hookprof.device.timing import Timer, timer_for
from hookprof.disabled import DisabledProfiler, InertProfiler
from hookprof.distributed import detect_local_rank, detect_rank
from hookprof.efficiency.figures import EfficiencyTotals, StepEfficiency
from hookprof.errors import DetachedError, MetaDeviceError
from hookprof.faults import Faults, ThreadSupervisor, guarded
from hookprof.layers import LayerTable
from hookprof.nonfinite.checks import NonfiniteChecks
from hookprof.nonfinite.incident import IncidentResponse
from hookprof.notices import Notices
from hookprof.phases.clock import BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, OUTSIDE
from hookprof.phases.recorder import PhaseClock
from hookprof.phases.stall import StallWatch, cuda_busy
from hookprof.publish.document import document
from hookprof.publish.publisher import Publisher
from hookprof.publish.publisher import for_model as publisher_for_model
from hookprof.serve.attachment import Serving
from hookprof.snapshot import Snapshot
from hookprof.step import statistics
from hookprof.step.backward_end import BackwardEnd
from hookprof.step.boundary import StepBoundary, no_step_notice
from hookprof.step.gradients import GradientNorms, StepGradients, no_gradients_notice
from hookprof.step.hooks import LayerHooks
from hookprof.step.record import StepCounters, StepRecord, loss_notice, pack_step, real_loss
from hookprof.step.sampled import SampledStep
from hookprof.step.series import StepSeries
from hookprof.view import summary

detach_all = live.detach_all


def attach(
    model: nn.Module, *, config: Config | None = None, layer_statistics: Any = (), **overrides: Any
) -> Profiler:
    """Instrument `model` and start serving its metrics. Returns the Profiler.

    `config` defaults to `Config.from_env()` (defaults, then HOOKPROF_* variables);
    `overrides` are Config fields and win over both. HOOKPROF_DISABLE=1 wins over everything
    and returns a profiler that does nothing. A model that already has a live profiler (or
    shares a module with one) raises AlreadyAttachedError naming it. `layer_statistics`: your
    own per-layer statistics of sampled steps, exported as hookprof_layer_<name>
    (hookprof/step/statistics.py)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"hookprof.attach expects a torch.nn.Module, got "
            f"{type(model).__module__}.{type(model).__qualname__}"
        )
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a hookprof.Config, got {type(config).__qualname__}")
    cfg = config if config is not None else Config.from_env()
    if overrides:
        cfg = cfg.replace(**overrides)
    if cfg.disable or env_disabled():
        return DisabledProfiler(model, cfg)  # type: ignore[return-value]
    return Profiler(model, cfg, layer_statistics=layer_statistics)


class Profiler:
    """Live instrumentation of one model. Use `detach()` (or a `with` block) to remove it.

    Steps are counted at each `torch.optim` optimizer step that updates this model's
    parameters (global optimizer hooks), so a plain training loop needs no other call.
    Calling `step(loss)` marks boundaries explicitly instead, from its first call on.

    Keyword arguments are collaborators a test (or an embedding program) may replace: the
    host clocks, the layer-call timer, the prometheus_client registry, the publisher class.
    """

    enabled = True

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        clock: Callable[[], int] = time.perf_counter_ns,
        wall_clock: Callable[[], float] = time.time,
        timer: Timer | None = None,
        registry: CollectorRegistry | None = None,
        publisher: Callable[..., Publisher] = Publisher,
        layer_statistics: Any = (),
    ):
        model, compiled = unwrap_compiled(model)
        # the model is held weakly (as in the layer table, the replay and the hooks): when
        # its owner drops it (a notebook cell run again), the next attach() finds it gone and
        # releases this profiler instead of serving a dead model for ever
        self._model_ref = weakref.ref(model)
        self.model_type = type(model).__qualname__
        self.config, self._clock, self._wall_clock = config, clock, wall_clock
        layer_statistics = statistics.checked(layer_statistics)
        live.release_orphans()
        live.refuse_overlap(frozenset(id(m) for m in model.modules()))
        self.table = LayerTable(model)
        if not self.table.params:
            raise ValueError(
                f"{type(model).__qualname__} has no parameters: there is nothing to "
                "train, so nothing for hookprof to profile"
            )
        if any(p.is_meta for p in self.table.params):  # deferred init: to_empty() makes new tensors
            raise MetaDeviceError(
                type(model).__qualname__, [n for n, p in model.named_parameters() if p.is_meta]
            )
        self.rank = config.rank if config.rank is not None else detect_rank()
        local_rank = config.local_rank if config.local_rank is not None else detect_local_rank()
        config.check_local_rank(local_rank, "LOCAL_RANK" if config.local_rank is None else None)
        self.timer: Timer = timer if timer is not None else timer_for(self.table.param_devices())
        self._faults = Faults()
        self._notices = Notices()
        self._counters = StepCounters(config.max_skipped_steps)
        self._series = StepSeries()  # every step's loss and gradient norm (step/series.py)
        norms = GradientNorms(self.table)
        norms.series = self._series
        self._grads = StepGradients(norms, every_step=config.nonfinite_check == "all")
        # the gradients as each backward left them (before a clip or a user's guard rewrites them)
        self._backward_end = BackwardEnd(
            self._grads.backward_ended if config.capsule_dir is None else self._backward_ended,
            self._faults,
            keep_output_grads=config.capsule_dir is not None
            and (config.nonfinite_sync or all(d.type == "cpu" for d in self.table.param_devices())),
            params=self.table.params,
        )
        self._hooks = LayerHooks(
            self.table,
            self.timer,
            self._faults,
            config.activation_stats,
            root=model,
            statistics=layer_statistics,
        )
        root_layer = next(
            (layer.index for layer in self.table.layers if layer.module is model), None
        )
        self._boundary = StepBoundary(
            model,
            self.table.params,
            root_layer,
            self,
            self._hooks,
            self._faults,
            clock,
            compiled,
            say=self._notices.say,
        )
        with contextlib.ExitStack() as undo:
            self.name = live.reserve_name(config.name or self.model_type)  # the `model` label
            undo.callback(live.remove, self, self.name)
            self._phases = PhaseClock(clock(), self.timer)  # host phases; device ones with CUDA
            self._watch = StallWatch.from_config(
                self._phases.progress,
                model,
                config,
                faults=self._faults,
                rank=self.rank,
                model_name=self.name,
                clock=clock,
                wall_clock=wall_clock,
                device_busy=cuda_busy(self.table.param_devices()),
            )
            self._efficiency = StepEfficiency.from_config(
                self.table, config, self._notices, self.model_type
            )
            if self._efficiency.flops is not None:
                self._efficiency.listen(self._hooks)
            self._publisher = publisher_for_model(
                publisher,
                self.table,
                self.rank,
                config,
                self._counters,
                self._faults,
                self.timer,
                self._notices,
                decorate=self._watch.decorate,
                device_phases=self._phases.device_totals(),
                statistics=layer_statistics,
                efficiency=EfficiencyTotals(self.table.names) if self._efficiency.enabled else None,
            )
            self._sampled = SampledStep(config, self._hooks, self.timer, self._publisher)
            self._nan = NonfiniteChecks(
                model,
                self.table,
                config,
                hooks=self._hooks,
                publisher=self._publisher,
                new_record=self._sampled.new_record,
                faults=self._faults,
                say=self._notices.say,
            )
            self._incidents = IncidentResponse(
                config,
                self.rank,
                self._nan.detector,
                self._publisher,
                self._drain_counters,
                self._nan.replay_pending,
                model=self.name,
                faults=self._faults,
                capsules=self._nan.capsules,
            )
            self._supervisor = ThreadSupervisor(self._faults, say=self._notices.say)
            self._supervisor.watch("publisher", self._publisher)
            if config.stall_detection:
                self._supervisor.watch("stall watch", self._watch)
            self._serving = Serving(
                config,
                self.name,
                self.rank,
                local_rank,
                self._publisher,
                registry,
                faults=self._faults,
                counters=self._counters,
            )
            earlier = live.earlier_notice(self.model_type, self.name) if config.serve else None
            if earlier:
                self._notices.say("earlier profiler", earlier)
            undo.enter_context(self._serving.join(self.report_document, self._supervisor))
            undo.enter_context(self._publisher.start())
            if config.stall_detection:
                undo.enter_context(self._watch.start())
            undo.enter_context(self._serving.start())
            if compiled:  # a hook added now would force a recompile, and do nothing in the graph
                explain_attached_after_compile(self._notices)
                self._backward_end.watch_params(self.table.params)
            undo.enter_context(self._boundary.install(model, self._nan.traced))
            undo.callback(self._release_step)
            self._begin_step(1, clock())
            live.add(self, self._boundary.module_ids, summary_at_exit=config.summary_at_exit)
            self._undo = undo.pop_all()

    # ---------------- public API ----------------

    @property
    def model(self) -> nn.Module | None:
        """The profiled model; None once its owner dropped it (released at the next attach())."""
        return self._model_ref()

    @property
    def url(self) -> str | None:
        """http://addr:port/metrics (shared by the process's models), or None when not serving."""
        return self._serving.url

    port = property(lambda self: self._serving.port, doc="The endpoint's port (None: not serving).")

    @property
    def registry(self) -> CollectorRegistry | None:
        """The prometheus_client registry of this model's metrics (the endpoint's if serving)."""
        return self._serving.registry

    @property
    def collector(self) -> Any:
        """This model's SnapshotCollector (the metrics built from its latest snapshot)."""
        return self._serving.collector

    detached = property(lambda self: self._boundary.detached, doc="detach() was called.")

    steps = property(
        lambda self: self._counters.steps, doc="Steps counted so far (a host counter: never waits)."
    )

    def snapshot(self) -> Snapshot:
        """The latest published statistics (hookprof.Snapshot); `flush()` first for up to now."""
        return self._publisher.latest

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Make `snapshot()` current: bring the every-step counters over and wait until the
        publisher has folded in everything up to now (on a GPU this waits for the device)."""
        if not self.detached:  # flags a replay waits for are waited for too: answered now
            self._nan.settle(self._counters.steps + 1)
            self._drain_counters()
        return self._incidents.flushed(self._publisher.flush(timeout), self.detached, timeout)

    def report_document(self, recent: int | None = None) -> dict[str, Any]:
        """The run report's data for this model (what /history.json serves; publish/document.py);
        with `recent`, only the last `recent` steps' loss and gradient norm."""
        return document(self.name, self._publisher.latest, self._publisher.history, recent)  # type: ignore[arg-type]

    def step(self, loss: Any = None) -> None:
        """Mark a step boundary; `loss` (tensor or number) is exported on sampled steps.

        From the first call on, only these calls end steps (optimizer steps no longer do).
        Call it once per optimizer step, after the backward pass.
        """
        if self._boundary.detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")
        if loss is not None and (
            type(loss) is not torch.Tensor or loss.numel() != 1 or loss.is_complex()
        ):
            loss, what = real_loss(loss)  # (the usual loss, a one-element real tensor, skips this)
            if what is not None:  # a (loss, outputs) tuple and the like: said once, steps go on
                self._notices.say("loss type", loss_notice(what))
        self._boundary.step(loss)

    @contextlib.contextmanager
    def expect_slow(self, what: str = "slow section") -> Any:
        """Mark a known long section (a checkpoint save, an evaluation, a profiler dump) on
        the training thread: while it runs the progress shows phase "outside" with `what` as
        its label, and the stall watch never judges it. Its time counts as phase "other".

            with prof.expect_slow("checkpoint"):
                torch.save(model.state_dict(), path)
        """
        back_to = self._phases.outside(what, self._clock())
        try:
            yield
        finally:
            if not self.detached:
                self._phases.back(back_to, self._clock())

    def detach(self) -> None:
        """Remove every hook, send the last sample, stop the thread and the server. Idempotent."""
        if self.detached:
            return
        self._boundary.close()
        self._backward_end.remove()  # (a graph built before detach() calls nothing)
        with self._faults.contain("detach", disable=False):
            self._drain_counters()  # counters of the steps since the last sample
            self._incidents.at_detach()  # a capsule still waiting for its incident: written now
        self._undo.close()
        if self.config.summary_at_exit:
            with self._faults.contain("summary", disable=False):  # never a failed detach()
                summary.say(summary.summary_text(self.snapshot(), self.name))

    def report(self, path: str | None = None) -> str:
        """Without `path`: the per-layer table as text (a header, then every layer by share of
        step time). With `path`: the run report written there as one self-contained HTML file
        (docs/report.md), and the path returned. Flushes first (on a GPU: waits for it)."""
        if not self.detached:
            self.flush()
        if path is not None:
            from hookprof.view.report_html import write  # the page's code loads when first drawn

            return write(path, [self.report_document()])
        from hookprof.view.table import report_text  # the table's code loads when first shown

        return report_text(self.snapshot(), self.name)

    def __enter__(self) -> Profiler:  # with hookprof.attach(model) as prof: ...
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        where = self.url or "not serving"
        state = "detached" if self.detached else "attached"
        return f"<hookprof.Profiler {self.model_type} rank={self.rank} {where} {state}>"

    def __deepcopy__(self, memo: dict) -> Any:  # copies are inert (_inert_copy)
        return _inert_copy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_copy, ())

    # ---------------- the life of one step: StepBoundary's events ----------------

    def _begin_step(self, number: int, now_ns: int) -> None:
        """Plan step `number`: sampled or not, with output checks or not; hooks in or out."""
        if self._boundary.latch_compiled():  # Dynamo traced the root: hooks stay out
            explain_compiled_forward(self._notices)
            self._backward_end.watch_params(
                self.table.params
            )  # (its output's node is in the graph)
        # an open incident samples every step (its window's end read first: one call less)
        incident = number <= self._incidents.open_until and self._incidents.open(number)
        self._nan.step_began()
        self._series.begin(number)
        record = self._sampled.begin(
            number,
            now_ns,
            incident=incident,
            compiled=self._boundary.compiled,
            broken=self._faults.layers_off(number),
        )
        self._grads.new_step(self._sampled.plan.sampled)
        if (
            record is not None or self._phases.bound
        ):  # a sampled step's phases are marked on the device too
            self._phases.bind(record)

    def _on_eval_forward(self) -> None:
        if self._phases.where[1] in (DATA, OTHER):  # an evaluation between steps
            self._phases.enter(OUTSIDE, self._clock(), "eval")

    def _on_forward(
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
        self._nan.capture(args, kwargs, module if entry else None, rerun=self._sampled.rerun_wanted)
        if self._sampled.plan.checked:
            self._hooks.note_root_inputs(args, kwargs)  # a NaN in the batch is the input's
        if first_step:
            self._phases.restart(now)
            self._watch.follow(threading.get_ident())
        self._phases.enter(FORWARD, now)

    def _on_output(self, output: Any) -> None:
        """The root's forward returned: check its output (every step)."""
        self._phases.enter(BACKWARD, self._clock())
        self._nan.check_output(output, step=self._counters.steps + 1)
        self._backward_end.watch(output)
        if self._sampled.unfolded:  # (a sampled step's, to fold)
            self._sampled.nudge()

    def _backward_ended(self) -> None:
        """capsule_dir set: the gradients checked, then a backward NaN's capsule drafted."""
        self._grads.backward_ended()
        end = self._backward_end
        grads, end.output_grads = end.output_grads, []  # (drafted on the CPU, or not needed)
        self._nan.backward_ended(self._grads.backward, grads, self._counters.steps + 1)

    def _on_update_began(self, optimizer: torch.optim.Optimizer) -> None:
        self._nan.update_began(self._counters.steps + 1)
        if self._sampled.rerun_wanted:
            self._sampled.record_by(self._nan.rerun)
        now = self._clock()
        self._phases.enter(OPTIMIZER, now)
        # the parameters before the update (a second optimizer of the step finds them taken)
        if self._sampled.plan.sampled:
            self._efficiency.before_update(now, optimizer)

    def _on_before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """This step's gradients are final and its parameters not updated yet."""
        self._grads.read_once(self._sampled.plan.sampled, at_update=True)
        if (view := self._nan.scaler_of(optimizer)) is not None:
            self._grads.unscale(view)
        self._nan.before_update(optimizer, self._grads.squares, self._counters.steps + 1)

    def _on_later_update(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer of the step an earlier optimizer ended (two optimizers, no prof.step())."""
        self._nan.later_update(optimizer)

    def _closure_judged(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._nan.judges_closure(optimizer)

    def _on_closure_call(self, judged: bool) -> None:
        self._nan.closure_call(judged)

    def _on_back_in_optimizer(self) -> None:
        self._phases.enter(OPTIMIZER, self._clock())  # the closure returned
        self._sampled.record_by(
            self._nan.rerun
        )  # its forward ran in the closure, the update comes next

    def _on_closure_returned(self, optimizer: torch.optim.Optimizer, judged: bool) -> None:
        if not judged:
            self._grads.forget()  # read once, at the step's end (.grad untouched)
            self._nan.replay_if_waiting(self._counters.steps + 1)
            return
        if not self._nan.holding:  # (a held step keeps its bad evaluation's squares)
            self._grads.forget()
        self._on_before_update(optimizer)

    def _on_any_update_done(self, owned: bool) -> None:
        self._nan.update_done(owned)

    def _on_optimizer_returned(self) -> None:
        if self._phases.progress.where[1] == OPTIMIZER:
            self._phases.enter(OTHER, self._clock())

    def _on_loss(self, loss: Any) -> None:  # prof.step(loss), before the step ends
        self._nan.check_loss(loss, self._counters.steps + 1)
        if loss is not None:
            self._series.loss(loss)

    def _on_late_loss(self, loss: Any) -> None:
        """prof.step(loss) after the optimizer hook ended the step: this adds its loss."""
        number = self._counters.steps
        self._nan.check_loss(loss, number, late=True)
        if loss is not None:
            self._series.loss(loss, number)
        if loss is not None and self._sampled.last_sent == number:  # it was a sampled step
            # sent on its own (a copy of one value on an accelerator): this happens once,
            # when prof.step() takes over after optimizer steps ended them
            self._publisher.submit(pack_step(number, None, [], loss=loss, sampled=False))
        self._incidents.at_step_end(number)

    def _on_step_end(
        self, loss: Any, *, skipped: bool, started_ns: int | None, forward_seen: bool
    ) -> tuple[int, int]:
        """The step boundary: count the step and pack a sampled one. Returns (number, now)."""
        nan, grads = self._nan, self._grads
        replay = nan.replay
        if (
            replay.flag is not None or (replay.kept and not self._grads.read_at_update)
        ) and not skipped:
            nan.replay_forward(self._counters.steps + 1)  # no optimizer hook ran: still this step's
        now = self._clock()
        if started_ns is None:  # a first step without a forward: no phases to tell
            self._phases.restart(now)
        start = started_ns if started_ns is not None else now
        checked = dropped = None
        if not skipped:
            checked, dropped = grads.at_step_end(
                self._sampled.plan.sampled
            )  # (read, if no optimizer hook did)
            if grads.squares is not None and not grads.squares[1] and forward_seen:  # read: none
                self._notices.say(
                    "no gradients", no_gradients_notice(self.model_type, grads.backward)
                )
        nan.at_step_end(checked, self._counters.steps + 1, dropped)
        duration_s = (now - start) * 1e-9
        number = self._counters.observe(duration_s, self._wall_clock(), skipped)
        # an update held back on the host changed no weight: like a GradScaler skip, no update
        # norm and no throughput (a fused kernel's skip on the device measures 0: efficiency.md)
        guard = nan.guard  # (nan.holding, inline)
        no_update = skipped or (guard is not None and guard.holding)
        if guard is not None:
            self._counters.set_held_back(nan.end_update(number) or 0)  # (with a guard: an int)
        self._phases.end_step(number, now)

        def pack(record: StepRecord | None) -> Any:
            efficiency, extra = self._efficiency_of(number, now, duration_s, no_update)
            packet = nan.pack(
                number,
                record,
                grad_squares=grads.squares,
                loss=loss,
                efficiency=efficiency,
                extra=extra,
                series=self._series.take(number),
            )
            packet.steps_at_end = self._counters.totals()
            return packet

        if self._sampled.plan.sampled and self._sampled.end(
            number, broken=self._faults.broken, pack=pack
        ):
            self._efficiency.drop()  # what a skipped or unsent step noted and copied goes
        return number, now

    def _on_step_ended(self, number: int, now: int) -> None:
        if self._sampled.plan.sampled or now >= self._supervisor.due_ns:  # not every step
            self._supervisor.check(now)
        self._incidents.at_step_end(number)
        if number >= self._series.due:  # the ring would be written over before a drain
            self._drain_counters()
        self._begin_step(number + 1, now)

    def _on_no_step_signal(self) -> None:
        """So many forwards without a step boundary: per-layer work stops (the record would
        grow with every call) until one comes; said once."""
        if self._sampled.stop():
            self._phases.bind(None)
        self._notices.say("no steps", no_step_notice(self.model_type))

    # ---------------- what the step's events call on ----------------

    @guarded("efficiency figures", disable=False, default=(None, ()))
    def _efficiency_of(
        self, number: int, now_ns: int, duration_s: float, skipped: bool
    ) -> tuple[Any, list[tuple[Any, torch.Tensor]]]:
        """A sampled step's FLOPs and norms (none when off, or skipped: no update, no
        throughput). A fault here costs only these figures: the step's others still go out."""
        if not self._efficiency.enabled or skipped:
            return None, []
        return self._efficiency.end_step(number, now_ns, duration_s)

    def _drain_counters(self) -> None:
        """Send the non-finite counters alone (no sampled step to carry them)."""
        steps = self._counters.steps
        self._nan.drain(steps, series=self._series.take(steps))

    def _release_step(self) -> None:
        """At detach: layer hooks out; a sampled step that never ended gives its events back."""
        self._supervisor.close()  # runs before the threads stop: none restarts after detach
        self._hooks.remove()
        self._efficiency.drop()
        self._sampled.release()


def _inert_copy() -> InertProfiler:
    """What a copy of an attached profiler is (pickles name this function: keep its path)."""
    return InertProfiler()
