"""`attach()` and the Profiler: hookprof's parts composed for one model.

Read top to bottom: `attach`; the construction (each part takes its slice of the config and
its collaborators; what each start returns goes on one teardown stack), ending with the
step's events (step_events.py: the life of a step as calls to the parts, in the order
`StepBoundary` tells them); the public methods; detach. Which part owns what:
docs/architecture.md, "One owner per state".
"""

from __future__ import annotations

import contextlib
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
    unwrap_compiled,
)
from hookprof.config import Config, env_disabled
from hookprof.device.timing import Timer, timer_for
from hookprof.disabled import DisabledProfiler, InertProfiler
from hookprof.distributed import detect_local_rank, detect_rank, with_other_ranks
from hookprof.efficiency.figures import EfficiencyTotals, StepEfficiency
from hookprof.errors import DetachedError, MetaDeviceError
from hookprof.faults import Faults, ThreadSupervisor
from hookprof.integrity.replicas import ReplicaCheck
from hookprof.layers import LayerTable
from hookprof.nonfinite.checks import NonfiniteChecks
from hookprof.nonfinite.incident import IncidentResponse
from hookprof.notices import Notices
from hookprof.phases.recorder import PhaseClock
from hookprof.phases.stall import StallWatch, cuda_busy
from hookprof.publish.document import document
from hookprof.publish.publisher import Publisher
from hookprof.publish.publisher import for_model as publisher_for_model
from hookprof.serve.attachment import Serving
from hookprof.snapshot import Snapshot
from hookprof.step import statistics
from hookprof.step.backward_end import BackwardEnd
from hookprof.step.boundary import StepBoundary
from hookprof.step.builtin_statistics import registered
from hookprof.step.gradients import GradientNorms, StepGradients
from hookprof.step.hooks import LayerHooks
from hookprof.step.record import StepCounters, loss_notice, real_loss
from hookprof.step.sampled import SampledStep
from hookprof.step.series import StepSeries
from hookprof.step.update_statistics import UpdateStatistics
from hookprof.step_events import CounterDrain, StepEvents, replays_of
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
        # hookprof's own per-layer statistics, then the user's: parts of one interface, one
        # index space (step/statistics.py, step/builtin_statistics.py)
        layer_statistics = registered(layer_statistics, update_norms=config.update_norms)
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
            self._grads.backward_ended,  # (with capsule_dir: the step's events, set below)
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
            # silent data corruption: the replicas' fingerprints (None: off, the default)
            self._replicas = ReplicaCheck.for_model(
                model, config, self.table.has_dtensor_params, self._notices.say
            )
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
                replica_group=self._replicas.group if self._replicas is not None else "",
                device_phases=self._phases.device_totals(),
                statistics=layer_statistics,
                efficiency=EfficiencyTotals(self.table.names) if self._efficiency.enabled else None,
            )
            # ranks of one job sample the same step numbers, to compare the same steps
            self._sampled = SampledStep(
                config, self._hooks, self.timer, self._publisher, aligned=with_other_ranks()
            )
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
            # the counters (and the every-step series) brought over without a sampled step
            self._drain = CounterDrain(self._counters, self._nan, self._series)
            self._incidents = IncidentResponse(
                config,
                self.rank,
                self._nan.detector,
                self._publisher,
                self._drain,
                self._nan.replay_pending,
                model=self.name,
                faults=self._faults,
                capsules=self._nan.capsules,
            )
            self._supervisor = ThreadSupervisor(self._faults, say=self._notices.say)
            # (layer index, module, its own parameters) of each layer, and where a statistic's
            # applies_to that raised is told: for the statistics of parameters and updates
            owned = [
                (layer.index, layer.module, [self.table.params[i] for i in layer.param_indices])
                for layer in self.table.layers
            ]

            def report(part: str, exc: BaseException) -> None:
                self._faults.report(part, exc, disable=False)

            self._events = StepEvents(
                model_type=self.model_type,
                params=self.table.params,
                clock=clock,
                wall_clock=wall_clock,
                faults=self._faults,
                notices=self._notices,
                counters=self._counters,
                series=self._series,
                grads=self._grads,
                backward_end=self._backward_end,
                hooks=self._hooks,
                boundary=self._boundary,
                phases=self._phases,
                watch=self._watch,
                efficiency=self._efficiency,
                publisher=self._publisher,
                sampled=self._sampled,
                nan=self._nan,
                incidents=self._incidents,
                supervisor=self._supervisor,
                drain=self._drain,
                replicas=self._replicas,
                **replays_of(  # (sdc_check_interval_s, spike_replay: None when off)
                    *(config, self.table, self.name, self.rank, self._faults, self._notices.say),
                    *(self._nan, self._hooks, self._sampled, self._publisher),
                ),
                sharded=self.table.has_dtensor_params,
                parameter_statistics=statistics.ParameterStatistics(
                    layer_statistics, owned, report=report
                ),
                update_statistics=UpdateStatistics(layer_statistics, owned, report=report),
            )
            if config.capsule_dir is not None or config.spike_replay:  # (step_events.py)
                self._backward_end.on_end = self._events.backward_ended
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
            undo.enter_context(self._events.output_sums(compiled))  # (Config.spike_replay)
            undo.enter_context(self._boundary.install(model, self._events, self._nan.traced))
            undo.callback(self._events.release)
            self._events.begin_step(1, clock())
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
            self._events.drain()  # (and an update's comparison waiting for its values)
        return self._incidents.flushed(self._publisher.flush(timeout), self.detached, timeout)

    def report_document(self, recent: int | None = None) -> dict[str, Any]:
        """The run report's data for this model (what /history.json serves; publish/document.py);
        with `recent`, only the last `recent` steps' loss and gradient norm."""
        return document(self.name, self._publisher.latest, self._publisher.history, recent)  # type: ignore[arg-type]

    def step(self, loss: Any = None, *, sample_losses: torch.Tensor | None = None) -> None:
        """Mark a step boundary; `loss` (tensor or number) is exported on sampled steps.
        `sample_losses`: each sample's loss in the batch (one row per sample, e.g.
        `reduction="none"`), for spike_replay to name a spike's samples of largest loss.

        From the first call on, only these calls end steps (optimizer steps no longer do).
        Call it once per optimizer step, after the backward pass."""
        if self._boundary.detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")
        if sample_losses is not None:
            self._events.note_sample_losses(sample_losses)
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
            self._events.drain()  # counters of the steps since the last sample
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


def _inert_copy() -> InertProfiler:
    """What a copy of an attached profiler is (pickles name this function: keep its path)."""
    return InertProfiler()
