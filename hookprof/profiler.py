"""`attach()` and the Profiler: step boundaries, sampling, and the hand-off to the publisher.

The training thread does three things here: count the step, decide once whether the next
step is sampled (and install or remove the per-layer hooks accordingly), and at the end of
a sampled step start one batched device-to-host copy. Everything else happens on the
publisher thread.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .aggregate import Aggregator, Packet, StepCounters
from . import transfer
from .batch import ScalarBatch
from .config import Config, env_disabled
from .distributed import detect_local_rank, detect_rank
from .errors import AlreadyAttachedError, DetachedError, NonFiniteError
from .nonfinite import Detector, loss_flag, nonfinite_flags
from . import incident as incident_policy
from .compiled import (
    CompileProbe,
    explain_attached_after_compile,
    explain_compiled_forward,
    is_compiling,
    unwrap_compiled,
)
from .exporter import SnapshotCollector, make_registry
from .system import SystemCollector, SystemSampler
from .gradients import GradientNorms
from .health import Health
from .instrument import LayerHooks, StepRecord
from .layers import LayerTable
from .publisher import Publisher
from .replay import ForwardReplay
from .sampling import Sampler
from .server import Limits, MetricsServer
from .snapshot import Snapshot
from .timing import timer_for

_live: set["Profiler"] = set()  # profilers not yet detached: the only global state
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
    """

    enabled = True

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        clock: Callable[[], int] = time.perf_counter_ns,
        wall_clock: Callable[[], float] = time.time,
        timer: Any = None,
    ):
        model, self._compiled = unwrap_compiled(model)
        self.model = model
        self.config = config
        self._compile_probe = CompileProbe()
        self._clock = clock
        self._wall_clock = wall_clock
        self._module_ids = frozenset(id(m) for m in model.modules())
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
        self.timer = timer if timer is not None else timer_for(self.table.param_devices())
        self._health = Health()
        self._counters = StepCounters(config.max_skipped_steps)
        self._sampler = Sampler(config.sample_every, config.min_sample_interval_s)
        self._gradients = GradientNorms(self.table)
        self._detector = Detector(len(self.table))
        self._replay = ForwardReplay(model)
        # the root module is a layer of its own when it owns parameters directly
        self._root_layer = next((layer.index for layer in self.table.layers if layer.module is model), None)
        if any(type(p).__name__ == "DTensor" for p in self.table.params):
            # FSDP2 / tensor parallel: re-running the forward on one rank would start
            # all-gathers the other ranks never join. A forward NaN is localised on the
            # following (sampled) steps instead.
            self._replay.done = True
        self._forward_peek: Any = None  # (host flag, ready event) of this step's output check
        # a parameter whose gradient tells "backward ran, then zero_grad" (GradScaler skips)
        self._sentinel = next((p for p in self.table.params if p.requires_grad), None)
        self._hooks = LayerHooks(self.table, self.timer, self._health, config.activation_stats,
                                 root=model)
        aggregator = Aggregator(
            self.table.names,
            [layer.module_type for layer in self.table.layers],
            self.rank,
            config.max_layers,
            (config.vanishing_grad_norm, config.exploding_grad_norm),
        )
        self._publisher = Publisher(
            aggregator,
            self._counters,
            self._health,
            self.timer,
            config.publish_interval_s,
            name=f"hookprof-publisher-rank{self.rank}",
        )
        self.collector = SnapshotCollector(lambda: self._publisher.latest, torch.__version__,
                                           lambda: self._publisher.alive)
        self._system: SystemSampler | None = None
        extra: tuple[Any, ...] = ()
        if config.system_metrics:
            self._system = SystemSampler(
                config.system_interval_s,
                gpus=config.gpu_metrics and local_rank == 0,  # one series per GPU per node
                name=f"hookprof-system-rank{self.rank}",
            )
            extra = (SystemCollector(lambda: self._system.latest, self.rank),)
        self.registry = make_registry(self.collector, process_metrics=config.system_metrics,
                                      extra=extra)

        # step state, touched by the training thread only
        self._sampled = False
        self._rec: StepRecord | None = None
        self._grad_squares: tuple[list[torch.Tensor], frozenset[int]] | None = None
        self._pending: tuple[ScalarBatch, Packet] | None = None  # ended, not yet sent
        self._step_start_ns: int | None = None
        self._forward_seen = False
        self._root_seen = False
        self._closed_by_optimizer = False
        self._manual = False
        self._detached = False
        self._optimizer_seen = False  # an optimizer owning our parameters has stepped
        self._stepped = False  # ... in the current step
        self._known_bad = 0  # non-finite steps the training thread has already reacted to
        self._incident_until = 0  # sample every step up to this step number
        self._flags: list[Any] = []  # per-step device flags in flight (policies but "record")
        self._acted = False
        self._checked = False  # this step has per-layer output checks
        self._last_checked_ns = -(1 << 62)
        self._check_interval_ns = int(config.activation_interval_s * 1e9)
        self._device_bad: dict[torch.device, int] = {}  # last flag read back per device
        self._opt_owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        self._server: MetricsServer | None = None
        self._handles: list[Any] = []
        try:
            if config.serve:
                port = config.port + local_rank if config.port else 0
                self._server = MetricsServer(
                    self.registry, config.addr, port, version=self._page_version,
                    certfile=config.tls_certfile,
                    keyfile=config.tls_keyfile, client_cafile=config.tls_client_cafile,
                    limits=Limits.from_config(config))
            if self._compiled:
                # a hook added now would force a recompile, and do nothing in the graph
                explain_attached_after_compile()
            else:
                self._handles.append(
                    model.register_forward_pre_hook(self._on_root_forward, prepend=True, with_kwargs=True)
                )
                self._handles.append(model.register_forward_hook(self._on_root_output))
            self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
            self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_post))
            self._begin_step(1, self._clock())
            self._publisher.start()
            if self._system is not None:
                self._system.start()
            with _live_lock:
                _live.add(self)
        except BaseException:
            self._teardown()
            raise

    # ---------------- public API ----------------

    @property
    def url(self) -> str | None:
        """http://addr:port/metrics, or None when not serving."""
        return self._server.url if self._server is not None else None

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    @property
    def detached(self) -> bool:
        return self._detached

    def snapshot(self) -> Snapshot:
        """The latest published statistics (see hookprof.Snapshot). Call `flush()` first to
        include everything up to now."""
        return self._publisher.latest

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Send any finished sampled step and wait until the publisher has folded it in."""
        if not self._detached:
            self._dispatch()
        return self._publisher.flush(timeout)

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
                self._check_loss(loss, self._counters.steps)
                if self._pending is not None and loss is not None:
                    self._add_loss(self._pending, loss)
                self._dispatch()
                self._react(self._counters.steps)
                return
            self._check_loss(loss, self._counters.steps + 1)
            skipped = self._optimizer_seen and not self._stepped and self._forward_seen
            self._end_step(loss, by_optimizer=False, skipped=skipped)
            self._dispatch()
        except NonFiniteError:
            raise
        except Exception as exc:
            self._health.report("step boundary", exc)

    def detach(self) -> None:
        """Remove every hook, send the last sample, stop the thread and the server. Idempotent."""
        if self._detached:
            return
        self._detached = True
        try:
            self._dispatch()
            self._drain_counters()  # counters of the steps since the last sample
        except Exception as exc:
            self._health.report("detach", exc, disable=False)
        self._teardown()

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        where = self.url or "not serving"
        state = "detached" if self._detached else "attached"
        return f"<hookprof.Profiler {type(self.model).__qualname__} rank={self.rank} {where} {state}>"

    # ---------------- step machinery (training thread) ----------------

    def _teardown(self) -> None:
        self._detached = True
        self._hooks.remove()
        if self._rec is not None:  # a sampled step that never ended: its events go back
            self.timer.release(self._rec.tokens())
            self._rec = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._publisher.stop()
        if self._system is not None:
            self._system.stop()
        if self._server is not None:
            self._server.close()
        with _live_lock:
            _live.discard(self)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        key = sum(len(g["params"]) for g in groups)
        cached = self._opt_owns.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        owns = any(id(p) in self._param_ids for g in groups for p in g["params"])
        self._opt_owns[optimizer] = (key, owns)
        return owns

    def __deepcopy__(self, memo: dict) -> "Profiler":
        return _inert_copy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_copy, ())

    def _on_root_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._detached:  # a copy of the model (see _inert_copy)
            return
        if is_compiling():
            self._compile_probe.seen = True  # Dynamo replays this after every compiled call
            return
        if self._hooks.replaying:
            return
        # marks noted by a forward that raised (no root output hook ran) would keep that
        # forward's graph alive: an out-of-memory retry must find its memory free
        self._hooks.drop_pending()
        # evaluation passes (under no_grad / inference_mode, or with the model in eval mode)
        # are not training steps: the layer hooks ignore them until the next training forward
        evaluating = not torch.is_grad_enabled() or not module.training
        self._hooks.paused = evaluating
        self._hooks.in_training_forward = not evaluating
        if evaluating:
            return
        try:
            if not self._replay.done and not self._checked:
                self._replay.capture(args, kwargs)
            self._root_seen = True
            if self._rec is not None and not self._hooks.installed:
                self._hooks.install()
                if self._root_layer is not None:
                    # this call's pre-hooks were fixed before ours ran: start the root's own
                    # timing by hand (its post-hook is picked up after forward, as usual)
                    self._hooks.start_call(self._root_layer, module, args)
            if self._forward_seen and self._skipped_by_scaler():
                # the last iteration ran backward and zero_grad but no optimizer step: the
                # GradScaler skipped it (its gradients held an Inf/NaN). A step, not an incident.
                self._end_step(None, by_optimizer=False, skipped=True)
            if not self._forward_seen:
                self._forward_seen = True
                self._closed_by_optimizer = False
                if self._step_start_ns is None:
                    self._step_start_ns = self._clock()
        except Exception as exc:
            self._health.report("forward pre-hook", exc)

    def _skipped_by_scaler(self) -> bool:
        return (
            not self._manual
            and self._optimizer_seen
            and not self._stepped
            and self._sentinel is not None
            and self._sentinel.grad is None
        )

    def _on_root_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._detached or is_compiling() or self._hooks.replaying:
            return
        if self._hooks.in_training_forward:
            self._hooks.in_training_forward = False
            self._hooks.mark_pending()
        if self._hooks.paused or not torch.is_grad_enabled():
            return
        try:
            # every step: one reduction of the model's output, counted where its result is
            flags = nonfinite_flags(output)
            step = self._counters.steps + 1
            for flag in flags:
                self._detector.add_flag("forward", flag, step)
            if flags and not self._replay.done and not self._checked:
                if any(f is True for f in flags):
                    self._forward_peek = (True, None)
                    self._maybe_replay()  # known at once: the parameters are still this step's
                else:
                    on_device = [f for f in flags if isinstance(f, torch.Tensor)]
                    if on_device:
                        self._forward_peek = transfer.peek(torch.stack(on_device).any())
            # the last sampled step goes to the publisher here rather than before this
            # forward: its Python work then overlaps the backward pass, which seldom needs
            # the GIL, not the forward, which needs it at every module call
            self._dispatch()
        except Exception as exc:
            self._health.report("forward hook", exc)

    def _maybe_replay(self) -> None:
        """If this step's output went non-finite on an unsampled step, replay its forward with
        the per-layer checks on, before the optimizer changes the parameters."""
        peek, self._forward_peek = self._forward_peek, None
        if peek is None or not transfer.is_ready(peek[1]):
            return
        host_flag = peek[0]
        if not bool(host_flag):  # a host tensor (or a completed copy): no device sync
            return
        rec = StepRecord(self.timer.mark())
        if self._replay.run(self._hooks, rec):
            self._submit_replay(rec)

    def _submit_replay(self, rec: StepRecord) -> None:
        batch = ScalarBatch()
        act_order = self._add_activations(batch, rec)
        blocks = self._add_counters(batch)
        packet = Packet(step=self._counters.steps + 1, record=rec, sampled=False,
                        act_order=act_order, counter_parts=blocks)
        packet.batch = batch.send()
        self._publisher.submit(packet)

    def _check_loss(self, loss: Any, step: int) -> None:
        if loss is None:
            return
        self._detector.add_flag("loss", loss_flag(loss), step)

    def _in_step(self) -> bool:
        # the root forward pre-hook tells a new step from a second optimizer of the same
        # step; a model driven without calling its root falls back to "every step ends one"
        return self._forward_seen or not self._root_seen

    def _on_optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():  # a compiled optimizer step: nothing to do inside its graph
            return
        try:
            if self._in_step() and self._owns(optimizer):
                self._optimizer_seen = self._stepped = True
                if self._forward_peek is not None:
                    self._maybe_replay()
                if self._grad_squares is None:
                    self._take_gradients()
        except Exception as exc:
            self._health.report("optimizer pre-hook", exc)

    def _on_optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if is_compiling():
            return
        try:
            if not self._manual and self._in_step() and self._owns(optimizer):
                self._end_step(None, by_optimizer=True)
        except NonFiniteError:
            raise
        except Exception as exc:
            self._health.report("optimizer hook", exc)

    def _take_gradients(self) -> None:
        """Per-layer squared gradient norms, folded into the device counters: on every step
        with nonfinite_check="all", else on sampled steps."""
        if self._health.broken or not (self._sampled or self.config.nonfinite_check == "all"):
            return
        self._grad_squares = self._gradients.layer_squares()
        self._detector.add_layer_squares(self._grad_squares[0], self._counters.steps + 1)

    def _begin_step(self, number: int, now_ns: int) -> None:
        if self._compile_probe.seen and not self._compiled:
            self._compiled = True
            explain_compiled_forward()
        # an open incident (a NaN/Inf whose layer is not known yet) samples every step
        incident = number <= self._incident_until and not self._localised()
        self._sampled = not self._health.broken and (
            self._sampler.should_sample(number, now_ns) or incident
        )
        # per-layer output checks on this step? (rate-limited apart from sampling)
        self._checked = self._sampled and self.config.activation_stats and (
            incident or now_ns - self._last_checked_ns >= self._check_interval_ns
        )
        if self._checked:
            self._last_checked_ns = now_ns
        self._hooks.activation_stats = self._checked
        self._grad_squares = None
        if self._sampled and not self._compiled:
            self._rec = StepRecord(self.timer.mark())
            # the first step's hooks go in at its first eager forward (_on_root_forward):
            # a model compiled after attach() must never see them, or Dynamo recompiles
            self._hooks.begin(self._rec, install=number > 1)
        elif self._hooks.installed:
            self._hooks.remove()

    def _end_step(self, loss: Any, *, by_optimizer: bool, skipped: bool = False) -> None:
        if self._forward_peek is not None and not skipped:
            self._maybe_replay()  # no optimizer hook ran: the parameters are still this step's
        now = self._clock()
        start = self._step_start_ns if self._step_start_ns is not None else now
        if not skipped and self._grad_squares is None:
            self._take_gradients()  # no optimizer hook ran (prof.step() without one)
        number = self._counters.observe((now - start) * 1e-9, self._wall_clock(), skipped)
        self._stepped = False
        if self._sampled:
            self._hooks.end()
            if not self._health.broken:  # a step whose hooks failed half-way is no sample
                self._dispatch()  # a sample still pending from an earlier step goes first
                self._pending = self._build_packet(number, loss)
            elif self._rec is not None:
                self.timer.release(self._rec.tokens())
        self._rec = None
        self._step_start_ns = now
        self._forward_seen = False
        self._closed_by_optimizer = by_optimizer
        self._react(number)
        self._begin_step(number + 1, now)

    def _localised(self) -> bool:
        event = self._publisher.latest.first_nonfinite
        return event is not None and event.layer is not None

    def _react(self, number: int) -> None:
        """At a step boundary: notice new NaN/Inf steps and act on them. Under "record" the
        news comes with each sampled step's drain; the other policies read one flag per step
        back from the device, without waiting for it."""
        if self.config.on_nonfinite != "record":
            self._poll_flag()
        snap = self._publisher.latest
        bad = sum(snap.nonfinite_steps.values())
        if bad <= self._known_bad:
            return
        self._known_bad = bad
        self._incident_until = number + self.config.incident_steps
        event = snap.first_nonfinite
        if self.config.on_nonfinite != "record" and event is not None and not self._acted:
            self._acted = True  # once per run: the first incident is the one that matters
            incident_policy.apply(self.config.on_nonfinite, event, snap, self.config, self.rank)

    def _poll_flag(self) -> None:
        for device, c in self._detector.by_device.items():
            self._flags.append((device, transfer.peek(c.phase_bad.sum().reshape(1))))
        while self._flags and transfer.is_ready(self._flags[0][1][1]):
            device, (host, _) = self._flags.pop(0)
            # a host tensor whose copy has completed: no sync; counts are cumulative
            self._device_bad[device] = int(host.sum())
        seen = self._detector.host_total() + sum(self._device_bad.values())
        if seen > self._known_bad:
            # something went bad: bring the counters over now so layer, phase and step are known
            self._drain_counters()
            self._publisher.flush()

    def _add_counters(self, batch: ScalarBatch) -> int:
        blocks = self._detector.blocks()
        for k, block in enumerate(blocks):
            batch.add(("counters", k), block)
        return len(blocks)

    def _drain_counters(self) -> None:
        batch = ScalarBatch()
        blocks = self._add_counters(batch)
        packet = Packet(step=self._counters.steps, batch=batch.send(), sampled=False,
                        counter_parts=blocks)
        self._publisher.submit(packet)

    def _build_packet(self, number: int, loss: Any) -> tuple[ScalarBatch, Packet]:
        batch = ScalarBatch()
        parts, has_grad = self._grad_squares or ([], frozenset())
        for k, part in enumerate(parts):
            batch.add(("grad_sq", k), part)
        rec = self._rec
        act_order = self._add_activations(batch, rec) if rec is not None else []
        blocks = self._add_counters(batch)
        packet = Packet(step=number, record=rec, grad_parts=len(parts), has_grad=has_grad,
                        act_order=act_order, counter_parts=blocks)
        pending = (batch, packet)
        if loss is not None:
            self._add_loss(pending, loss)
        return pending

    @staticmethod
    def _add_activations(batch: ScalarBatch, rec: StepRecord) -> list[int]:
        """Stack a record's activation reductions, one stack per device; returns which
        record entry each stacked value is."""
        act_order: list[int] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, entry in enumerate(rec.act):
            by_device.setdefault(entry[1].device, []).append(i)
        for indices in by_device.values():
            act_order.extend(indices)
            batch.add("act_min", torch.stack([rec.act[i][1] for i in indices]))
            batch.add("act_max", torch.stack([rec.act[i][2] for i in indices]))
            nonzero = [rec.act[i][3] for i in indices if rec.act[i][3] is not None]
            if nonzero:
                batch.add("nonzero", torch.stack(nonzero))
        return act_order

    @staticmethod
    def _add_loss(pending: tuple[ScalarBatch, Packet], loss: Any) -> None:
        batch, packet = pending
        if isinstance(loss, torch.Tensor):
            batch.add("loss", loss.detach().reshape(-1)[:1])
            packet.loss_in_batch = True
        else:
            packet.loss = float(loss)

    def _dispatch(self) -> None:
        """Start the one device-to-host copy of a finished sampled step and hand it over."""
        self._check_threads()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        batch, packet = pending
        packet.batch = batch.send()
        self._publisher.submit(packet)


    def _page_version(self) -> tuple[Any, ...]:
        """What the /metrics page is made from: it is re-rendered when any of these changes."""
        system = self._system.latest if self._system is not None else None
        return (self._publisher.latest, system, self._publisher.alive)

    def _check_threads(self) -> None:
        """hookprof's own threads end only when detach() stops them: one that ended anyway
        (its loop catches every Exception, so something stronger killed it) is reported
        (log, hookprof_internal_errors_total; the publisher also as
        hookprof_publisher_thread_up 0) and started again, a few times at most."""
        if not self._publisher.alive:
            self._revive("publisher", self._publisher)
        if self._server is not None and not self._server.alive:
            self._revive("metrics server", self._server)

    def _revive(self, what: str, part: Any) -> None:
        err = RuntimeError(f"hookprof {what} thread died")
        if part.restarts >= MAX_RESTARTS:
            if part.restarts == MAX_RESTARTS:
                self._health.report(f"{what} thread (not restarted again)", err, disable=False)
                part.restarts += 1
            return
        self._health.report(f"{what} thread (restart {part.restarts + 1})", err, disable=False)
        try:
            part.restart()
        except Exception as exc:  # e.g. the port was taken meanwhile: reported, not raised
            self._health.report(f"{what} thread restart", exc, disable=False)


MAX_RESTARTS = 3  # per thread


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
        self.rank = 0
        self._detached = False

    @property
    def detached(self) -> bool:
        return self._detached

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def flush(self, timeout: float | None = 10.0) -> bool:
        return True

    def step(self, loss: Any = None) -> None:
        if self._detached:
            raise DetachedError("Profiler.step() called after detach(); attach the model again")

    def detach(self) -> None:
        self._detached = True

    def __enter__(self) -> "DisabledProfiler":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return "<hookprof.Profiler disabled (HOOKPROF_DISABLE)>"
