"""`attach()` and the Profiler: the life of one step, and the wiring of everything else.

The training thread does little here: at the root module's forward it notes that a step
began; at the step boundary (a torch.optim step of this model's parameters, or
`prof.step()`) it reads the gradients on the device, counts the step, packs a sampled step's
scalars for their one device-to-host copy, lets the incident response look at what the
publisher knows, and plans the next step (sampled or not, hooks in or out). Per-layer hooks
(instrument.py), folding (aggregate.py, on the publisher thread) and serving (exporter.py,
server.py) live elsewhere.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from hookprof.publish.aggregate import Aggregator
from hookprof.compiled import (
    CompileProbe,
    explain_attached_after_compile,
    explain_compiled_forward,
    is_compiling,
    unwrap_compiled,
)
from hookprof.config import Config, env_disabled
from hookprof.distributed import detect_local_rank, detect_rank
from hookprof.errors import AlreadyAttachedError, DetachedError, NonFiniteError
from hookprof.serve.exporter import SnapshotCollector, make_registry
from hookprof.efficiency.figures import EfficiencyTotals, StepEfficiency
from hookprof.faults import Faults, ThreadSupervisor
from hookprof.notices import Notices
from hookprof.step import gradscaler
from hookprof.step.gradients import GradientNorms
from hookprof.nonfinite.guard import ScalerView, SkipCounters, UpdateGuard, host_flags_of_squares
from hookprof.publish.history import LAYER_SLOTS, History
from hookprof.nonfinite.incident import IncidentResponse
from hookprof.step.hooks import LayerHooks
from hookprof.layers import LayerTable
from hookprof.nonfinite.detector import Detector, loss_flag, nonfinite_flags
from hookprof.phases.clock import BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, OUTSIDE, Progress
from hookprof.phases.device import DevicePhaseTotals, PhaseMarks
from hookprof.publish.publisher import Publisher
from hookprof.step.record import StepCounters, StepRecord, pack_step
from hookprof.nonfinite.output import OutputFlags
from hookprof.nonfinite.replay import ForwardReplay, own_weights_nonfinite
from hookprof.step.plan import UNSAMPLED, StepPlanner
from hookprof.serve import endpoint
from hookprof.serve.endpoint import Endpoint, Member
from hookprof.snapshot import Snapshot
from hookprof.view import summary
from hookprof.serve.system import SystemCollector, SystemSampler
from hookprof.device.timing import Timer, timer_for
from hookprof.phases.stall import StallWatch, cuda_busy

_names: set[str] = set()  # the `model` labels of live profilers
_live: set["Profiler"] = set()  # profilers not yet detached: the only global state
log = logging.getLogger("hookprof")
_live_lock = threading.Lock()


def attach(model: nn.Module, *, config: Config | None = None, **overrides: Any) -> "Profiler":
    """Instrument `model` and start serving its metrics. Returns the Profiler.

    `config` defaults to `Config.from_env()` (defaults, then HOOKPROF_* variables);
    `overrides` are Config fields and win over both. HOOKPROF_DISABLE=1 wins over everything
    and returns a profiler that does nothing. Attaching a model that already has a live
    profiler (or shares a module with one) raises AlreadyAttachedError naming it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"hookprof.attach expects a torch.nn.Module, got {type(model).__module__}."
            f"{type(model).__qualname__}"
        )
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a hookprof.Config, got {type(config).__qualname__}")
    cfg = config if config is not None else Config.from_env()
    if overrides:
        cfg = cfg.replace(**overrides)
    if cfg.disable or env_disabled():
        return DisabledProfiler(model, cfg)
    return Profiler(model, cfg)


class Profiler:
    """Live instrumentation of one model. Use `detach()` (or a `with` block) to remove it.

    Steps are counted at each `torch.optim` optimizer step that updates this model's
    parameters (global optimizer hooks), so a plain training loop needs no other call.
    Calling `step(loss)` marks boundaries explicitly instead, from its first call on.

    The keyword arguments are collaborators a test (or an embedding program) may replace:
    the host clocks, the timer of layer calls, the prometheus_client registry the metrics
    are registered in, and the publisher (a class or factory with Publisher's signature).
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
    ):
        model, self._compiled = unwrap_compiled(model)
        # the model is held weakly (as in the layer table, the replay and the hooks): when
        # its owner drops it (a notebook cell run again), the next attach() finds it gone and
        # releases this profiler instead of serving a dead model for ever
        self._model_ref = weakref.ref(model)
        self.model_type = type(model).__qualname__
        self.config = config
        self._compile_probe = CompileProbe()
        self._clock = clock
        self._wall_clock = wall_clock
        self._module_ids = frozenset(id(m) for m in model.modules())
        _release_orphans()
        with _live_lock:
            for other in _live:
                if not other._module_ids.isdisjoint(self._module_ids):
                    raise AlreadyAttachedError(other)

        self.table = LayerTable(model)
        if not self.table.params:
            raise ValueError(
                f"{type(model).__qualname__} has no parameters: there is nothing to train, "
                "so nothing for hookprof to profile"
            )
        self._param_ids = frozenset(id(p) for p in self.table.params)
        self.rank = config.rank if config.rank is not None else detect_rank()
        local_rank = config.local_rank if config.local_rank is not None else detect_local_rank()
        self.timer: Timer = timer if timer is not None else timer_for(self.table.param_devices())

        # the parts, each the one owner of its state
        self._faults = Faults()
        self._notices = Notices()
        self._counters = StepCounters(config.max_skipped_steps)
        self._planner = StepPlanner(config.sample_every, config.min_sample_interval_s,
                                    config.activation_stats, config.activation_interval_s)
        self._gradients = GradientNorms(self.table)
        self._detector = Detector(len(self.table))
        # a GradScaler's skips of a fused optimizer, and the updates held back on the
        # device (on_nonfinite "skip"/"raise"), are counted on the device
        self._scaler_skips = SkipCounters(config.max_skipped_steps)
        self._held_back = SkipCounters(config.max_skipped_steps)
        self._guard = (UpdateGuard(config.nonfinite_sync, self._notices.say)
                       if config.on_nonfinite in ("skip", "raise") else None)
        # FSDP2 / tensor parallel: re-running the forward on one rank would start all-gathers
        # the other ranks never join, so a forward NaN is localised on the following
        # (sampled) steps instead
        self._replay = ForwardReplay(model, enabled=not self.table.has_dtensor_params,
                                     keep_late=self._guard is not None, say=self._notices.say)
        self._replay_token = 0  # the publisher's publish_now token of the replay's packet
        self._hooks = LayerHooks(self.table, self.timer, self._faults, config.activation_stats,
                                 root=model)
        aggregator = Aggregator(
            self.table.names,
            [layer.module_type for layer in self.table.layers],
            self.rank,
            config.max_layers,
            (config.vanishing_grad_norm, config.exploding_grad_norm),
            container_names=[name for name, _ in self.table.containers],
        )
        # the report's bounded history, fed by the publisher thread after each fold
        self._history = History(self.table.names, layer_slots=min(LAYER_SLOTS, config.max_layers))
        with _live_lock:  # the `model` label: unique among the models of this process
            self.name = _unique_name(config.name or type(model).__qualname__)
        # where the training thread is (a few stores at the step's boundaries), and the
        # thread that judges from it whether the run is stuck
        self._progress = Progress(clock())
        self._watch = StallWatch(
            self._progress, model, factor=config.stall_factor, min_s=config.stall_min_s,
            max_s=config.stall_max_s, warmup_steps=config.stall_warmup_steps, faults=self._faults,
            rank=self.rank, model_name=self.name, clock=clock, wall_clock=wall_clock,
            device_busy=cuda_busy(self.table.param_devices()),
            name=f"hookprof-stall-watch-rank{self.rank}")
        # FLOPs, throughput, weight and update norms of sampled steps (efficiency.py)
        self._efficiency = StepEfficiency(
            self.table, flops=config.flop_counting, update_norms=config.update_norms,
            update_max_bytes=config.update_norm_max_bytes, peak_flops=config.peak_flops,
            notices=self._notices, model_name=self.model_type,
            update_interval_s=config.update_norm_interval_s)
        if self._efficiency.enabled:
            aggregator.efficiency = EfficiencyTotals(self.table.names)
        # device time per step phase: with a device timer only (on the host clock it would
        # repeat hookprof_step_phase_seconds); marked on sampled steps (device_phases.py)
        self._phase_marks = PhaseMarks(self._progress, self.timer) if self.timer.kind == "cuda" else None
        if self._phase_marks is not None:
            aggregator.device_phases = DevicePhaseTotals()
        self._phases: Progress | PhaseMarks = self._progress  # what the step's boundaries write
        if self._efficiency.flops is not None:
            self._efficiency.listen(self._hooks)
        self._publisher = publisher(
            aggregator,
            self._counters,
            self._faults,
            self.timer,
            config.publish_interval_s,
            name=f"hookprof-publisher-rank{self.rank}",
            notices=self._notices,
            history=self._history,
            decorate=self._watch.decorate,
        )
        self._incidents = IncidentResponse(config, self.rank, self._detector, self._publisher,
                                           self._drain_counters, self._replay_pending)
        self._supervisor = ThreadSupervisor(self._faults)
        self._supervisor.watch("publisher", self._publisher)
        if config.stall_detection:
            self._supervisor.watch("stall watch", self._watch)
        publisher = self._publisher
        self.collector = SnapshotCollector(lambda: publisher.latest, torch.__version__,
                                           lambda: publisher.alive, rank=self.rank, model=self.name)
        # serving: the process's endpoint owns the page, the system sampler and the registry
        # (self.registry is then the endpoint's); otherwise they are this profiler's own
        self._endpoint: Endpoint | None = None
        self._system: SystemSampler | None = None
        self._registered: list[Any] = []  # collectors put in a caller's registry: taken out at detach
        if not config.serve:
            extra: tuple[Any, ...] = ()
            if config.system_metrics:
                self._system = SystemSampler(
                    config.system_interval_s,
                    gpus=config.gpu_metrics and local_rank == 0,  # one series per GPU per node
                    name=f"hookprof-system-rank{self.rank}",
                )
                extra = (SystemCollector(lambda: self._system.latest, self.rank),)
            self.registry = make_registry(self.collector, process_metrics=config.system_metrics,
                                          extra=extra, registry=registry,
                                          registered=self._registered if registry is not None else None)

        # the root layer, when the root module owns parameters directly, keeps a hook pair
        self._root_layer = next((layer.index for layer in self.table.layers if layer.module is model), None)
        self._opt_owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        # the current step, touched by the training thread only
        self._plan = UNSAMPLED  # sampled? with output checks?
        self._rec: StepRecord | None = None  # what a sampled step's hooks write
        self._grad_squares: tuple[list[torch.Tensor], frozenset[int]] | None = None
        self._scaler_view: ScalerView | None = None  # a fused optimizer's GradScaler state
        self._masked: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (squares, checked)
        self._output = OutputFlags()  # this step's output checks (the one owner)
        self._last_sent = 0  # the number of the last sampled step sent to the publisher
        self._unfolded = False  # ... and the publisher has not been nudged to fold it yet
        self._step_start_ns: int | None = None
        # step boundaries: who ends a step, and what this one has seen so far
        self._manual = False  # prof.step() has been called: only it ends steps
        self._root_seen = False  # the root module's forward has run at least once
        self._forward_seen = False  # ... in this step
        self._forwards = 0  # training forwards of the root in this step
        self._stepped = False  # an optimizer owning our parameters stepped in this step
        self._scaler_skipped = False  # a GradScaler skipped such an optimizer in this step
        self._closed_by_optimizer = False  # this step was ended by the optimizer hook
        self._detached = False

        self._handles: list[Any] = []
        # hooks on the root's children, for loops that never call the root's forward
        # (Lightning's training_step, model.compute_loss(x)): removed at its first one
        self._entry_handles: list[Any] = []
        self._entry: nn.Module | None = None  # the entry call in progress
        try:
            if config.serve:
                port = config.port + local_rank if config.port else 0
                self._tell_of_earlier(model)
                member = Member(self.name, SnapshotCollector(
                    lambda: publisher.latest, torch.__version__, lambda: publisher.alive,
                    rank=self.rank, model=self.name, build_info=False), self._page_version,
                    document=self.report_document)
                self._endpoint = endpoint.join(member, config, port, self.rank, local_rank)
                self.registry = self._endpoint.registry
                self._supervisor.watch("metrics server", self._endpoint)
            if self._compiled:
                # a hook added now would force a recompile, and do nothing in the graph
                explain_attached_after_compile(self._notices)
            else:
                self._handles.append(
                    model.register_forward_pre_hook(self._on_root_forward, prepend=True, with_kwargs=True)
                )
                self._handles.append(model.register_forward_hook(self._on_root_output))
                self._entry_handles = self._hook_entries(model)
            self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_post))
            self._handles.append(gradscaler.watch(self._on_scaler_decision))
            self._begin_step(1, self._clock())
            self._publisher.start()
            if config.stall_detection:
                self._watch.start()
            if self._system is not None:
                self._system.start()
            with _live_lock:
                _live.add(self)
            if config.summary_at_exit:
                summary.watch(self)
        except BaseException:
            self._teardown()
            raise

    # ---------------- public API ----------------

    @property
    def model(self) -> nn.Module | None:
        """The profiled model; None once its owner dropped it (the profiler is then released
        at the next attach(), or by detach() / hookprof.detach_all())."""
        return self._model_ref()

    @property
    def url(self) -> str | None:
        """http://addr:port/metrics (shared by every model of the process that asked for the
        same port), or None when not serving."""
        return self._endpoint.url if self._endpoint is not None else None

    @property
    def port(self) -> int | None:
        return self._endpoint.port if self._endpoint is not None else None

    @property
    def detached(self) -> bool:
        return self._detached

    @property
    def _server(self) -> Any:
        """The process endpoint's MetricsServer (tests and benchmarks look at its page)."""
        return self._endpoint.server if self._endpoint is not None else None

    @property
    def steps(self) -> int:
        """Steps counted so far (a host counter: never waits)."""
        return self._counters.steps

    def snapshot(self) -> Snapshot:
        """The latest published statistics (see hookprof.Snapshot). Call `flush()` first to
        include everything up to now."""
        return self._publisher.latest

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Make `snapshot()` current: bring the every-step counters over and wait until the
        publisher has folded in everything up to now (on a GPU this waits for the device)."""
        if not self._detached:
            self._drain_counters()
        return self._publisher.flush(timeout)

    def report_document(self) -> dict[str, Any]:
        """The run report's data for this model: its bounded history and per-layer totals
        (what /history.json serves; see hookprof/report.py)."""
        from hookprof.publish.document import document

        return document(self.name, self._publisher.latest, self._history)

    def step(self, loss: Any = None) -> None:
        """Mark a step boundary; `loss` (tensor or number) is exported on sampled steps.

        From the first call on, only these calls end steps (optimizer steps no longer do).
        Call it once per optimizer step, after the backward pass.
        """
        if self._detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")
        try:
            self._manual = True
            if self._closed_by_optimizer and not self._forward_seen:
                # the optimizer hook already ended this step: this call adds its loss
                self._closed_by_optimizer = False
                number = self._counters.steps
                self._check_loss(loss, number)
                if loss is not None and self._last_sent == number:  # it was a sampled step
                    # sent on its own (a copy of one value on an accelerator): this happens
                    # once, when prof.step() calls begin after optimizer steps ended them
                    self._publisher.submit(pack_step(number, None, [], loss=loss, sampled=False))
                self._incidents.at_step_end(number)
                return
            self._check_loss(loss, self._counters.steps + 1)
            skipped = self._scaler_skipped and not self._stepped
            self._end_step(loss, by_optimizer=False, skipped=skipped)
        except NonFiniteError:
            raise
        except Exception as exc:
            self._faults.report("step boundary", exc)

    @contextlib.contextmanager
    def expect_slow(self, what: str = "slow section") -> Any:
        """Mark a known long section (a checkpoint save, an evaluation, a profiler dump) on
        the training thread: while it runs the progress shows phase "outside" with `what` as
        its label, and the stall watch never judges it. Its time counts as phase "other".

            with prof.expect_slow("checkpoint"):
                torch.save(model.state_dict(), path)
        """
        progress = self._progress
        step, phase, _, label = progress.where
        self._phases.enter(OUTSIDE, self._clock(), what)
        try:
            yield
        finally:
            if not self._detached and progress.where[0] == step:  # the step did not end inside
                self._phases.enter(phase, self._clock(), label)

    def detach(self) -> None:
        """Remove every hook, send the last sample, stop the thread and the server. Idempotent."""
        if self._detached:
            return
        self._detached = True
        try:
            self._drain_counters()  # counters of the steps since the last sample
        except Exception as exc:
            self._faults.report("detach", exc, disable=False)
        self._teardown()
        if self.config.summary_at_exit:
            try:  # a summary must never make detach() fail
                summary.say(summary.summary_text(self.snapshot(), self.name))
            except Exception as exc:
                self._faults.report("summary", exc, disable=False)

    def report(self, path: str | None = None) -> str:
        """Without `path`: the per-layer table as text: a header (steps, step time, loss,
        gradient norm, NaN/Inf and the first offender), then every layer by share of step
        time. With `path`: the run report written there, one self-contained HTML file (step
        time, loss and gradient norm over the run, per-layer time, gradient norm per layer over
        time, the NaN timeline; docs/report.md), and the path returned. Brings the snapshot up
        to date first (flush(): on a GPU this waits for the device)."""
        if not self._detached:
            self.flush()
        if path is not None:
            from hookprof.view.report_html import render

            page = render([self.report_document()])
            with open(path, "w", encoding="utf-8") as f:
                f.write(page)
            return path
        from hookprof.view.table import report_text  # the table's code loads when first shown

        return report_text(self.snapshot(), self.name)

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        where = self.url or "not serving"
        state = "detached" if self._detached else "attached"
        return f"<hookprof.Profiler {self.model_type} rank={self.rank} {where} {state}>"

    def __deepcopy__(self, memo: dict) -> "Profiler":
        return _inert_copy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_copy, ())

    # ---------------- the life of one step (training thread) ----------------

    def _begin_step(self, number: int, now_ns: int) -> None:
        """Plan step `number`: sampled or not, with output checks or not; hooks in or out."""
        if self._compile_probe.seen and not self._compiled:
            self._compiled = True
            explain_compiled_forward(self._notices)
        incident = self._incidents.open(number)  # an open incident samples every step
        self._plan = self._planner.plan(number, now_ns, incident=incident, broken=self._faults.broken)
        self._grad_squares = None
        self._scaler_view = None
        self._masked = None
        self._output.clear()
        if self._plan.sampled and not self._compiled:
            self._rec = StepRecord(self.timer.start())
            # the first step's hooks go in at its first eager forward (_on_root_forward):
            # a model compiled after attach() must never see them, or Dynamo recompiles
            self._hooks.begin(self._rec, install=number > 1, activation_stats=self._plan.checked)
        elif self._hooks.installed:
            self._hooks.remove()
        # a sampled step's phase boundaries are marked on the device too; others write the
        # progress record alone, at no extra cost
        self._phases = self._progress if self._rec is None or self._phase_marks is None \
            else self._phase_marks.bind(self._rec)

    def _hook_entries(self, model: nn.Module) -> list[Any]:
        handles = []
        for child in model.children():
            handles.append(child.register_forward_pre_hook(self._on_entry_forward, with_kwargs=True))
            handles.append(child.register_forward_hook(self._on_entry_output, always_call=True))
        return handles

    def _drop_entry_hooks(self) -> None:
        for handle in self._entry_handles:
            handle.remove()
        self._entry_handles = []
        self._entry = None

    def _on_entry_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A child of the root is called from outside any call of the model's modules: the
        loop drives the model without its root forward (training_step, compute_loss), and
        this call is the step's forward as far as hookprof can see. It gets what a root call
        gets: the step begins, its inputs are checked and kept for a replay, its output is
        checked (a NaN in them is the input's; one made by the root's own code between two
        entry calls is seen as a non-finite input of the second)."""
        if is_compiling() or self._detached or self._entry is not None or self._hooks.replaying:
            return  # (detached before the rest: a copy of the model holds an inert profiler)
        self._entry = module
        self._forward_began(module, args, kwargs, own_layer=None, entry=True)

    def _on_entry_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or self._detached or self._entry is not module:
            return
        self._entry = None
        self._on_root_output(module, args, output)

    def _on_root_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._detached:  # a copy of the model (see _inert_copy)
            return
        if (not is_compiling() and self._entry_handles
                and torch.is_grad_enabled() and module.training):
            self._drop_entry_hooks()  # the root's own forward runs: it is the step's forward
        self._forward_began(module, args, kwargs, own_layer=self._root_layer, entry=False)

    def _forward_began(self, module: nn.Module, args: Any, kwargs: Any, own_layer: int | None,
                       entry: bool) -> None:
        """The root module's forward begins: the step has begun; its inputs are kept for a
        replay. (Its callers return at once for a copy of the model, see _inert_copy.)"""
        if is_compiling():
            self._compile_probe.seen = True  # Dynamo replays this after every compiled call
            return
        if self._hooks.replaying:
            return
        # evaluation passes (under no_grad / inference_mode, or with the model in eval mode)
        # are not training steps
        training = torch.is_grad_enabled() and module.training
        self._hooks.root_forward_began(training)
        if not training:
            if self._progress.where[1] in (DATA, OTHER):  # an evaluation between steps
                self._phases.enter(OUTSIDE, self._clock(), "eval")
            return
        try:
            now = self._clock()
            if not self._plan.checked:  # an unchecked step may need a replay
                # (the root is never held: the replay keeps the model weakly)
                self._replay.capture(args, kwargs, module if entry else None)
            self._root_seen = True
            if self._rec is not None and not self._hooks.installed and not entry:
                # (an entry call's own forward was looked up before its pre-hooks ran: a
                # wrapper installed now would be missed, so step 1's layers go unrecorded)
                self._hooks.install()
                if own_layer is not None:
                    # this call's pre-hooks were fixed before ours ran: start the root's own
                    # timing by hand (its post-hook is picked up after forward, as usual)
                    self._hooks.start_call(own_layer, module, args)
            if self._plan.checked:  # a NaN in the batch is the input's, not a layer's
                self._hooks.note_root_inputs(args, kwargs)
            if not self._forward_seen:
                self._forward_seen = True
                self._closed_by_optimizer = False
                if self._step_start_ns is None:  # the first step begins
                    self._step_start_ns = now
                    self._phases.restart(now)
                    self._watch.follow(threading.get_ident())
            self._phases.enter(FORWARD, now)
            self._forwards += 1
            if self._forwards == MAX_FORWARDS_PER_STEP:
                self._no_step_signal()
        except Exception as exc:
            self._faults.report("forward pre-hook", exc)

    def _on_root_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root module's forward returned: check its output (every step)."""
        if self._detached or is_compiling() or self._hooks.replaying:
            return
        training = self._hooks.root_output_arrived()
        if not training or not torch.is_grad_enabled():
            return
        try:
            self._phases.enter(BACKWARD, self._clock())
            # every step: one reduction of the model's output, counted where its result is
            self._output.add(nonfinite_flags(output))  # counted once per step, at its end
            if not self._plan.checked and self._replay.note_output(self._output.forward_flag):
                self._replay_forward()  # known at once: the parameters are still this step's
            # the publisher folds the last sampled step now: its Python work then overlaps
            # the backward pass, which seldom needs the GIL, not the forward, which needs it
            # at every module call
            if self._unfolded:
                self._unfolded = False
                self._publisher.nudge()
        except Exception as exc:
            self._faults.report("forward hook", exc)

    def _on_optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """An optimizer is about to update: the gradients are final, the parameters still
        this step's (the last moment for a replay). With a closure (LBFGS, Lightning's
        automatic optimization, sharpness-aware optimizers) the step's forward and backward
        have not run yet: they run inside the closure, so the closure is wrapped (a replay
        check after each call) and the gradients are read once, when the step ends, after
        the closure's last backward (an optimizer step leaves .grad as it found it)."""
        if is_compiling():  # a compiled optimizer step: nothing to do inside its graph
            return None
        try:
            if not self._owns(optimizer):
                return None
            if self._guard is not None:
                self._guard.begin_update()
            now = self._clock()
            self._phases.enter(OPTIMIZER, now)
            # the parameters before the update; also in a closure step, whose forward has not
            # run yet (a second optimizer of the step finds them taken)
            if self._plan.sampled:
                self._efficiency.before_update(now, optimizer)
            # args are those of the unbound step: (optimizer, closure?, ...)
            closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
            if callable(closure):
                wrapped = self._after_closure(closure, optimizer)
                if "closure" in kwargs:
                    return args, {**kwargs, "closure": wrapped}
                return (args[0], wrapped, *args[2:]), kwargs
            if self._in_step():
                self._before_update(optimizer)
        except Exception as exc:
            self._faults.report("optimizer pre-hook", exc)
        return None

    def _after_closure(self, closure: Callable[[], Any],
                       optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        # skip/raise: judged as each call of the closure returns (the optimizer's update reads
        # its gradients next), unless an inner optimizer makes the update (its pre-hook judges)
        judge = self._guard is not None and not self._guard.delegates(optimizer)

        def closure_then_read() -> Any:
            self._forwards = 0  # LBFGS calls it thousands of times in one step
            if judge:  # the closure finds the gradients it left, and the optimizer
                self._guard.after_update()  # no found_inf of an earlier evaluation
            result = closure()
            self._phases.enter(OPTIMIZER, self._clock())  # back in the optimizer's step
            try:  # called once or several times (LBFGS); the parameters are still this step's
                if self._in_step():
                    self._stepped = True
                    if not judge:
                        self._grad_squares = None  # read once, at the step's end (.grad untouched)
                        if self._replay.waiting:
                            self._replay_forward()
                    else:  # (a held step keeps its bad evaluation's squares, for the backward check)
                        if not self._guard.holding:
                            self._grad_squares = None
                        self._before_update(optimizer)
            except Exception as exc:
                self._faults.report("optimizer closure", exc)
            return result

        return closure_then_read

    def _before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """This step's gradients are final and its parameters not updated yet."""
        self._stepped = True
        if self._grad_squares is None:
            self._read_gradients()
        view = ScalerView(optimizer)
        if view.active:  # inside GradScaler.step with a fused optimizer: its skip is on the device
            self._scaler_view = view
            self._scaler_skips.add(view.found_inf)
            if self._grad_squares is not None:
                self._grad_squares = (view.unscale(self._grad_squares[0]), self._grad_squares[1])
        if self._guard is not None:
            squares = self._grad_squares[0] if self._grad_squares is not None else []
            flags = self._output.step_flags() + host_flags_of_squares(self._checked_squares(squares))
            self._guard.before_update(optimizer, self.table.params, flags)
        # the replay after the guard (neither changes a weight): under nonfinite_sync the
        # guard's wait, for a flag copied after the output's, leaves that one on the host,
        # so the training thread waits once per step, not twice
        if self._replay.waiting or self._replay.late:
            self._replay_forward()

    def _on_optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():
            return
        try:
            if self._guard is not None:
                self._guard.after_update()
            if not self._owns(optimizer):
                return
            # only the post-hook of the step in progress: a subclass calling super().step()
            # runs the hooks twice when both classes were patched by torch, the outer one
            # after this hook ended the step
            if not self._manual and self._in_step():
                self._end_step(None, by_optimizer=True)  # the optimizer phase ends with it
            elif self._progress.where[1] == OPTIMIZER:
                self._phases.enter(OTHER, self._clock())
        except NonFiniteError:
            raise
        except Exception as exc:
            self._faults.report("optimizer hook", exc)

    def _on_scaler_decision(self, optimizer: torch.optim.Optimizer, skipped: bool) -> None:
        """A GradScaler decided an optimizer's step: a skip (its gradients overflowed) ends
        the step as a skipped one, as the optimizer's own step would have ended it. A step,
        not an incident, unless skips go on for more than max_skipped_steps in a row."""
        if not skipped or self._detached:
            return
        try:
            if self._in_step() and self._owns(optimizer):
                if self._manual:
                    self._scaler_skipped = True  # prof.step() ends it
                else:
                    self._end_step(None, by_optimizer=True, skipped=True)
        except NonFiniteError:
            raise
        except Exception as exc:
            self._faults.report("GradScaler hook", exc)

    def _end_step(self, loss: Any, *, by_optimizer: bool, skipped: bool = False) -> None:
        """The step boundary: count the step, pack a sampled step, react, plan the next."""
        if (self._replay.waiting or self._replay.late) and not skipped:
            self._replay_forward()  # no optimizer hook ran: the parameters are still this step's
        now = self._clock()
        if self._step_start_ns is None:  # a first step without a forward: no phases to tell
            self._phases.restart(now)
        start = self._step_start_ns if self._step_start_ns is not None else now
        if not skipped:
            if self._grad_squares is None:
                self._read_gradients()  # no optimizer hook ran (prof.step() without one)
            if self._grad_squares is not None:  # once per step, however often they were read
                self._detector.add_layer_squares(self._checked_squares(self._grad_squares[0]),
                                                 self._counters.steps + 1)
                if not self._grad_squares[1] and self._forward_seen:
                    self._notices.say("no gradients", (
                        f"no parameter of {self.model_type} had a gradient at the "
                        "end of a step that ran its forward, so gradient norms and the "
                        "per-layer backward check have nothing to read: end steps after the "
                        "backward and before zero_grad() (prof.step() there, or a torch.optim "
                        "step); gradients computed functionally (torch.func) are not in .grad"))
        self._count_output_flags(self._counters.steps + 1)
        duration_s = (now - start) * 1e-9
        number = self._counters.observe(duration_s, self._wall_clock(), skipped)
        # an update the guard held back on the host changed no weight: like a GradScaler
        # skip, no update norm (not 0) and no throughput (a fused kernel that skipped on the
        # device is unknown here: its update measures 0, docs/efficiency.md)
        no_update = skipped or (self._guard is not None and self._guard.holding)
        if self._guard is not None:  # held back: counted once per step, however often acted on
            if self._guard.unguarded:
                self._replay.unheld(number)  # its update reached the weights: no late replay
            held_on_device = self._guard.end_step()
            if held_on_device is not None:
                self._held_back.add(held_on_device)
            self._counters.held_back = self._guard.held_back
        self._phases.end_step(number, now)
        self._stepped = self._scaler_skipped = False
        if self._plan.sampled:
            self._hooks.end()
            if not self._faults.broken:  # a step whose hooks failed half-way is no sample
                efficiency, extra = self._efficiency_of(number, now, duration_s, no_update)
                # its one device-to-host copy starts now; the publisher folds it when nudged
                # (the next forward's end) or within publish_interval_s, whichever comes first
                packet = pack_step(number, self._rec, self._detector.blocks(), counts=self._device_counts(),
                                   grad_squares=self._grad_squares, loss=loss,
                                   efficiency=efficiency, extra=extra)
                packet.steps_at_end = self._counters.totals()
                self._publisher.submit(packet)
                self._last_sent, self._unfolded = number, True
            elif self._rec is not None:
                self.timer.release(self._rec.tokens())
            self._efficiency.drop()  # what a skipped or unsent step noted and copied goes
        self._rec = None
        self._step_start_ns = now
        self._forward_seen = False
        self._forwards = 0
        self._closed_by_optimizer = by_optimizer
        self._supervisor.check()
        self._incidents.at_step_end(number)
        self._begin_step(number + 1, now)

    # ---------------- what the step boundary calls on ----------------

    def _in_step(self) -> bool:
        # the root forward pre-hook tells a new step from a second optimizer of the same
        # step; a model driven without calling its root falls back to "every step ends one"
        return self._forward_seen or not self._root_seen

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        key = sum(len(g["params"]) for g in groups)
        cached = self._opt_owns.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        owns = any(id(p) in self._param_ids for g in groups for p in g["params"])
        self._opt_owns[optimizer] = (key, owns)
        return owns

    def _read_gradients(self) -> None:
        """Per-layer squared gradient norms on the device (checked at the step's end): on
        every step with nonfinite_check="all", else on sampled steps."""
        if self._faults.broken or not (self._plan.sampled or self.config.nonfinite_check == "all"):
            return
        self._grad_squares = self._gradients.layer_squares()

    def _efficiency_of(self, number: int, now_ns: int, duration_s: float,
                       skipped: bool) -> tuple[Any, list[tuple[Any, torch.Tensor]]]:
        """A sampled step's FLOPs and norms, for its packet (none when off or skipped: a
        skipped step made no update, and its time is no training throughput)."""
        if not self._efficiency.enabled or skipped:
            return None, []
        try:
            return self._efficiency.end_step(number, now_ns, duration_s)
        except Exception as exc:  # the step's other figures still go out
            self._faults.report("efficiency figures", exc, disable=False)
            return None, []

    def _check_loss(self, loss: Any, step: int) -> None:
        if loss is None:
            return
        self._detector.add_flag("loss", loss_flag(loss), step)

    def _replay_forward(self) -> None:
        """If this step's output went non-finite on an unchecked step, replay its forward
        with the per-layer checks on, before the optimizer changes the parameters."""
        step = self._counters.steps + 1
        try:
            rec = self._replay.run_if_bad(self._hooks, lambda: StepRecord(self.timer.start()),
                                          step, wait=self.config.nonfinite_sync)
            if rec is None and self._replay.keep_late:  # an earlier step's flag may have arrived
                late = self._replay.run_late(self._hooks, lambda: StepRecord(self.timer.start()))
                if late is not None:
                    step, rec = late
        except Exception as exc:
            # the replay (once per run) is over either way, and put back what it changed; the
            # hook or step boundary that called it goes on (a late replay runs at a step's
            # end: an exception out of here cost that step its count). Hooks stay on.
            self._faults.report("forward replay", exc, disable=False)
            return
        if rec is not None:
            weights = [("weights_bad", f) for f in own_weights_nonfinite(self.table.layers)]
            self._publisher.submit(pack_step(step, rec, self._detector.blocks(),
                                             counts=self._device_counts(), sampled=False,
                                             extra=weights))
            if self._replay.keep_late:  # skip/raise: the policy may be waiting for its layer
                self._replay_token = self._publisher.publish_now()

    def _replay_pending(self, bad_step: int) -> bool:
        """Can the forward replay still name the producer of `bad_step`'s NaN: a kept step
        up to it not looked at yet, or the replay's packet not published yet?"""
        return (self._replay.may_replay(bad_step)
                or self._publisher.published_token < self._replay_token)

    def _checked_squares(self, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        """The squares the backward check counts: none on a step a fused optimizer's
        GradScaler skips (masked once per step, for the guard and the detector alike)."""
        if self._scaler_view is None:
            return squares
        if self._masked is None or self._masked[0] is not squares:
            self._masked = (squares, self._scaler_view.mask(squares))
        return self._masked[1]

    def _count_output_flags(self, step: int) -> None:
        """A step is non-finite in its forward once, however many forwards (siamese nets,
        a discriminator on real and fake, entry calls) and output tensors it had: one flag
        per device, one host bool."""
        for flag in self._output.step_flags():  # combined as they came (OutputFlags)
            self._detector.add_flag("forward", flag, step)
        self._output.clear()

    def _device_counts(self) -> dict[str, list[torch.Tensor]]:
        """The device counters drained beside the non-finite ones (aggregate.fold reads them)."""
        return {"scaler_skips": self._scaler_skips.blocks(), "held_back": self._held_back.blocks()}

    def _drain_counters(self) -> None:
        """Send the non-finite counters alone (no sampled step to carry them)."""
        self._publisher.submit(pack_step(self._counters.steps, None, self._detector.blocks(), counts=self._device_counts(),
                                         sampled=False))

    def _no_step_signal(self) -> None:
        """So many forwards without a step boundary: no torch.optim optimizer steps this
        model's parameters and nobody calls prof.step(). Per-layer work stops here (the
        step's record would grow with every call, its hooks cost every call) until a step
        boundary comes; said once."""
        if self._rec is not None:
            self._hooks.remove()
            self.timer.release(self._rec.tokens())
            self._rec = None
            self._phases = self._progress
            self._plan = UNSAMPLED
        self._notices.say("no steps", (
            f"{MAX_FORWARDS_PER_STEP} forwards of {self.model_type} without a step "
            "boundary: no torch.optim optimizer steps its parameters and prof.step() is not "
            "called, so hookprof cannot tell steps apart; per-layer timing and gradient norms "
            "are off until one comes. Call prof.step(loss) once per training step (after the "
            "parameter update)."))

    def _page_version(self) -> tuple[Any, ...]:
        """What this model's part of the /metrics page is made from: the page is re-rendered
        when any of these changes."""
        return (self._publisher.latest, self._publisher.alive)

    def _tell_of_earlier(self, model: nn.Module) -> None:
        """A profiler of a model of the same class is still attached: a second model of a
        kind, or a notebook cell run again (whose earlier model would be served for ever)."""
        with _live_lock:
            earlier = [p.name for p in _live if p.model_type == self.model_type]
        if earlier:
            self._notices.say("earlier profiler", (
                f"another {type(model).__qualname__} is attached in this process (served as "
                f"model={earlier[0]!r}); this one is served as model={self.name!r}. If a notebook "
                "cell ran again, hookprof.detach_all() releases the earlier one"))

    def _teardown(self) -> None:
        self._detached = True
        self._hooks.remove()
        if hasattr(self, "_efficiency"):  # absent when attach failed before making it
            self._efficiency.drop()
        if self._rec is not None:  # a sampled step that never ended: its events go back
            self.timer.release(self._rec.tokens())
            self._rec = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._drop_entry_hooks()
        self._publisher.stop()
        if hasattr(self, "_watch"):
            self._watch.stop()
        if self._system is not None:
            self._system.stop()
        if self._endpoint is not None:
            self._endpoint.leave(self.name)
        for collector in self._registered:
            self.registry.unregister(collector)
        self._registered = []
        with _live_lock:
            _live.discard(self)
            _names.discard(getattr(self, "name", None))
        summary.forget(self)


def detach_all() -> int:
    """Detach every profiler of this process (a notebook cell that attached again, a test's
    cleanup). Returns how many were detached."""
    with _live_lock:
        live = list(_live)
    for prof in live:
        prof.detach()
    return len(live)


def _release_orphans() -> None:
    """Detach every live profiler whose model is gone: a notebook cell that runs
    `model = Net(); prof = hookprof.attach(model)` again drops the earlier model, and its
    profiler would otherwise keep the port, its threads and its global optimizer hooks for
    ever. Called at attach(), on the attaching thread."""
    with _live_lock:
        live = list(_live)
    if not live:
        return
    if any(p._model_ref() is not None for p in live):
        # a dropped model can be held a little longer by a reference cycle of its own:
        # collect once, here, where a pause is expected (one full collection per attach,
        # only while another profiler is live)
        gc.collect()
    for prof in live:
        if prof._model_ref() is None and not prof._detached:
            log.info("hookprof: released the profiler of %s (model=%r): its model is gone (a "
                     "notebook cell run again, or a model dropped without detach())",
                     prof.model_type, prof.name)
            prof.detach()


def _unique_name(base: str) -> str:
    """`base`, or `base-2`, `base-3`, ... : the first not taken by a live profiler. Called
    under _live_lock; the name is held until detach."""
    name, k = base, 1
    while name in _names:
        k += 1
        name = f"{base}-{k}"
    _names.add(name)
    return name


# more training forwards than this between two step boundaries means there are none
# (gradient accumulation over 1,000 micro-batches is far beyond what runs use)
MAX_FORWARDS_PER_STEP = 1000


def _inert_copy() -> Profiler:
    """What a copy of an attached model (copy.deepcopy, pickling: EMA and SWA copies,
    whole-model checkpoints) holds in place of the profiler: the root hooks, copied with the
    model's hook dicts, find it detached and do nothing. Only the original is profiled."""
    inert = Profiler.__new__(Profiler)
    inert._detached = True
    return inert


class DisabledProfiler:
    """What attach() returns under HOOKPROF_DISABLE=1: the same surface, doing nothing."""

    enabled = False
    url = None
    port = None
    collector = None
    registry = None

    def __init__(self, model: nn.Module, config: Config):
        self.model = model
        self.config = config
        self.name = config.name or type(model).__qualname__
        self.rank = 0
        self._detached = False

    @property
    def detached(self) -> bool:
        return self._detached

    steps = 0

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def flush(self, timeout: float | None = 10.0) -> bool:
        return True

    def step(self, loss: Any = None) -> None:
        if self._detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")

    def report_document(self) -> dict[str, Any]:
        from hookprof.publish.document import document

        return document(self.name, Snapshot(), History([]))

    def expect_slow(self, what: str = "slow section") -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def detach(self) -> None:
        self._detached = True

    def report(self, path: str | None = None) -> str:
        said = "hookprof is disabled (HOOKPROF_DISABLE or Config.disable): nothing was recorded"
        if path is None:
            return said
        from hookprof.view.report_html import render

        with open(path, "w", encoding="utf-8") as f:
            f.write(render([], source=said))
        return path

    def __enter__(self) -> "DisabledProfiler":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return "<hookprof.Profiler disabled (HOOKPROF_DISABLE)>"
