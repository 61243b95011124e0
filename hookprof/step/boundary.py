"""Step boundaries: which torch hook calls begin a step, make its forward, update it and end it.

Owns: the hooks on the root module (and on its children, for loops that never call the root:
Lightning's `training_step`, `model.compute_loss(x)`), the listening of one profiler to the
process's optimizer step hooks (step/dispatch.py) and its GradScaler watch, and the step's flags:
whether `prof.step()` took
over, whether the root ever ran, what this step has seen (a forward, an owned optimizer's
update, a GradScaler skip), when it started, whether the optimizer already ended it.

It decides *which* event happened and tells the profiler's `StepEvents` (step_events.py),
through the `StepListener` protocol, in the order the profiler's parts need; it does none of
their work. Fault containment: every hook is
`guarded`, so an exception in a part is counted and never reaches the training loop.

Called by: torch (the hooks), and the `Profiler` (`install`, `step`, `close`).

A step ends at the update (an owned torch.optim step, a GradScaler skip of one, or
`prof.step()`), however often the model is called in between (docs/nonfinite.md, "What a
step is"). A model driven without calling its root falls back to "every update ends one".
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hookprof.compiled import CompileProbe, is_compiling, is_exporting, transformed
from hookprof.faults import Faults, guarded
from hookprof.handles import Handle, HandleGroup
from hookprof.step import copies, dispatch, gradscaler
from hookprof.step.hooks import LayerHooks

_PARAMS = operator.itemgetter("params")

# more training forwards than this between two step boundaries means there are none
# (gradient accumulation over 1,000 micro-batches is far beyond what runs use)
MAX_FORWARDS_PER_STEP = 1000


def trains_in_eval_notice(model_type: str) -> str:
    """Said once when an optimizer stepped after forwards of the model in eval mode only."""
    return (
        f"{model_type} trains in eval mode (model.eval() while gradients flow and an "
        "optimizer steps, as in fine-tuning with frozen BatchNorm): from the next step on "
        "its forwards with gradients enabled are training forwards, whatever "
        "module.training says (this step's forward was taken for an evaluation: its layer "
        "calls are not recorded); a forward under no_grad or inference_mode stays an "
        "evaluation."
    )


def no_step_notice(model_type: str) -> str:
    """Said once when MAX_FORWARDS_PER_STEP forwards came without a step boundary."""
    return (
        f"{MAX_FORWARDS_PER_STEP} forwards of {model_type} without a step boundary: no "
        "torch.optim optimizer steps its parameters and prof.step() is not called, so "
        "hookprof cannot tell steps apart; per-layer timing and gradient norms are off until "
        "one comes. Call prof.step(loss) once per training step (after the parameter update)."
    )


def model_changed_notice(model_type: str, names: list[str]) -> str:
    """Said once when an optimizer steps parameters of the model that were not there at
    attach() (a head added, LoRA adapters injected, load_state_dict(assign=True))."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"{model_type} changed after attach(): an optimizer steps {len(names)} of its "
        f"parameters that were not there at attach ({shown}). Steps are counted, but these "
        "parameters have no gradient norms (the global norm leaves them out) and no "
        "per-layer figures; re-attach to cover them: prof.detach(); "
        "prof = hookprof.attach(model)."
    )


class TracedForward(Protocol):
    """What the root's hooks do while Dynamo traces them (nonfinite/traced.py): tensor ops
    and attribute stores only, which compile into the graph."""

    def note_inputs(self, args: Any, kwargs: Any) -> None: ...

    def note_output(self, output: Any) -> None: ...


class StepListener(Protocol):
    """What is done at each event the boundary tells apart: the profiler's StepEvents
    (step_events.py), given to `install`."""

    def on_eval_forward(self) -> None: ...
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
    ) -> None: ...
    def on_output(self, output: Any) -> None: ...
    def on_update_began(self, optimizer: torch.optim.Optimizer, *, final: bool) -> None: ...
    def on_later_update(self, optimizer: torch.optim.Optimizer) -> None: ...
    def closure_judged(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def on_closure_call(self, judged: bool) -> None: ...
    def on_back_in_optimizer(self) -> None: ...
    def on_closure_returned(self, optimizer: torch.optim.Optimizer, judged: bool) -> None: ...
    def on_any_update_done(self, owned: bool, *, returned: bool) -> None: ...
    def on_no_step_signal(self) -> None: ...
    def on_late_loss(self, loss: Any) -> None: ...
    def on_step_end(
        self, loss: Any, *, skipped: bool, started_ns: int | None, forward_seen: bool
    ) -> tuple[int, int]: ...
    def on_step_ended(self, number: int, now: int) -> None: ...


@dataclass(slots=True)
class StepState:
    """What the step in progress has seen, as the boundary's hooks found it. One object,
    replaced whole when the step ends (StepBoundary._end_step), so that nothing of a step
    outlives it by a reset forgotten in one place."""

    start_ns: int | None = None  # when it began (the previous step's end); None: the first
    closed_by_optimizer: bool = False  # the optimizer hook ended the previous step (a late loss)
    forward_seen: bool = False  # a training forward of the model ran
    forwards: int = 0  # training forwards of the root (LBFGS: thousands in one step)
    stepped: bool = False  # an optimizer owning our parameters stepped
    scaler_skipped: bool = False  # a GradScaler skipped such an optimizer


class StepBoundary:
    """The step boundaries of one profiled model (training thread and autograd threads)."""

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[torch.Tensor],
        root_layer: int | None,
        hooks: LayerHooks,
        faults: Faults,
        clock: Callable[[], int],
        compiled: bool,
        say: Callable[[str, str], None] | None = None,
    ):
        self.module_ids = frozenset(id(m) for m in model.modules())
        self._param_ids = frozenset(id(p) for p in params)
        self._root_layer = root_layer  # the root's own layer, when it owns parameters directly
        self._events: StepListener  # what is told of each event: given by install
        self._hooks = hooks  # the per-layer hooks: told of the root's calls, and replaying
        self._faults = faults
        self._clock = clock
        self.compiled = compiled  # the model runs under torch.compile: no per-layer hooks
        self.probe = CompileProbe()  # its mark: Dynamo ran the root's hooks (latch_compiled)
        self._traced: TracedForward | None = None  # the output check compiled into the graph
        self._owned: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # optimizer -> (key, owns)
        self._last_owned: tuple[Any, bool] = (
            None,
            False,
        )  # (optimizer, owns) of the update in progress
        self._handles = HandleGroup()
        self._entry_handles = HandleGroup()  # on the root's children, until the root's own forward
        self._entry: nn.Module | None = None  # the entry call in progress
        # the root call whose pre-hook ran last is a transform's (jit.trace, vmap, export:
        # _on_root_forward), until its output hook
        self._in_transform = False
        self.detached = False  # detach() was called (written under the lock, read anywhere)
        # held while a step ends or a training forward begins, and by close(): once close()
        # returns, no step end or forward on another thread is half-way through putting the
        # layer hooks back in after detach took them out (re-entrant: a part may end a step
        # from inside one, as prof.step() inside a hook does)
        self._lock = threading.RLock()
        self.manual = False  # prof.step() has been called: only it ends steps
        self._root_seen = False  # the root module's forward has run at least once
        self._step = StepState()  # what this step has seen: replaced whole at its end
        # training in eval mode (frozen BatchNorm): a grad-enabled forward of the model in
        # eval mode is a training forward when the run trains that way. Told apart from a
        # validation pass that forgot no_grad by what follows: an owned optimizer stepping
        # after such forwards only (no train-mode forward since the last update) means the
        # run trains in eval mode; an update after a train-mode forward means it does not
        self._trains_in_eval = False
        self._eval_grad_seen = False  # a grad-enabled eval-mode forward since the last update
        self._train_mode_seen = False  # a grad-enabled train-mode forward since the last update
        self._say = say
        self._model_type = type(model).__name__
        # the model, for what it holds *now*: an optimizer over parameters added after attach
        # (model surgery) still steps this model (weak: the profiler never keeps it alive)
        self._model_ref = weakref.ref(model)

    # ---------------- installing and removing ----------------

    def install(
        self, model: nn.Module, events: StepListener, traced: TracedForward | None = None
    ) -> Handle:
        """Hook the root, its children (unless compiled before attach: their entry hooks
        serve eager loops only), the optimizers and GradScaler; returns what removes them
        all. A registration that fails takes the others out before it raises. `events`:
        what is told of each event; `traced`: what the root's hooks do inside a compiled
        graph."""
        self._events = events
        self._traced = traced
        try:
            self._register(model)
        except BaseException:
            self._remove()
            raise
        return Handle(self._remove)

    def _register(self, model: nn.Module) -> None:
        # first: a copy of the model (EMA, SWA, torch.save) must never carry what follows
        self._handles.add(copies.Placed(model))
        # the root's pair also on a model compiled before attach: traced with it, it is the
        # output NaN check inside the graph and keeps the inputs for a replay (a model that
        # already ran compiled recompiles once for it; one compiled after attach does not)
        self._handles.add(
            model.register_forward_pre_hook(self._on_root_forward, prepend=True, with_kwargs=True)
        )
        self._handles.add(model.register_forward_hook(self._on_root_output))
        if not self.compiled:
            for child in model.children():
                if isinstance(child, torch.jit.ScriptModule):
                    continue  # takes no Python hooks; a loop calls the root of such a model
                self._entry_handles.add(
                    child.register_forward_pre_hook(self._on_entry_forward, with_kwargs=True)
                )
                self._entry_handles.add(
                    child.register_forward_hook(self._on_entry_output, always_call=True)
                )
        # through the process's one pair of optimizer hooks: adding or removing a hook of
        # torch's own while another thread's optimizer steps breaks that step (dispatch.py)
        self._handles.add(dispatch.listen(self._on_optimizer_pre, self._on_optimizer_post))
        self._handles.add(gradscaler.watch(self._on_scaler_decision))

    def close(self) -> None:
        """Detached: every hook from now on does nothing (also a copy's, see _inert). Waits
        for a step end or forward in progress on another thread to finish first."""
        with self._lock:
            self.detached = True
            self._last_owned = (None, False)

    def _remove(self) -> None:
        try:
            self._handles.remove()
        finally:
            self._drop_entry_hooks()

    def _drop_entry_hooks(self) -> None:
        self._entry = None
        self._entry_handles.remove()

    def latch_compiled(self) -> bool:
        """True once, when a compiled call of the model was first seen (Dynamo ran the root's
        hooks while tracing): from then on the model runs under torch.compile."""
        if self.probe.seen and not self.compiled:
            self.compiled = True
            return True
        return False

    def __deepcopy__(self, memo: dict) -> StepBoundary:
        return _inert()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())

    # ---------------- where the step is ----------------

    def in_step(self) -> bool:
        # the root forward pre-hook tells a new step from a second optimizer of the same
        # step; a model driven without calling its root falls back to "every step ends one"
        return self._step.forward_seen or not self._root_seen

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        key = sum(map(len, map(_PARAMS, groups)))  # C-level: no Python call per group
        cached = self._owned.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        params = [p for g in groups for p in g["params"]]
        owns = any(id(p) in self._param_ids for p in params)
        new = [p for p in params if id(p) not in self._param_ids]
        if new:  # once per optimizer and parameter groups: never on the hot path
            owns = self._changed_model(new) or owns
        self._owned[optimizer] = (key, owns)
        return owns

    def _changed_model(self, new: list[torch.Tensor]) -> bool:
        """Are any of `new` (an optimizer's parameters unknown at attach) parameters of the
        model now? Then the model changed after attach: the optimizer steps it (its steps are
        counted), and a notice names what the layer table does not cover."""
        model = self._model_ref()
        if model is None:
            return False
        new_ids = {id(p) for p in new}
        names = [name for name, p in model.named_parameters() if id(p) in new_ids]
        if names and self._say is not None:
            self._say("model changed", model_changed_notice(self._model_type, names))
        return bool(names)

    # ---------------- the forward ----------------

    def _on_entry_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A child of the root is called from outside any call of the model's modules: the
        loop drives the model without its root forward (training_step, compute_loss), and
        this call is the step's forward as far as hookprof can see. It gets what a root call
        gets: the step begins, its inputs are checked and kept for a replay, its output is
        checked (a NaN in them is the input's; one made by the root's own code between two
        entry calls is seen as a non-finite input of the second)."""
        if (
            is_compiling()
            or self.detached
            or self._entry is not None
            or self._hooks.replaying
            or transformed()
        ):
            return  # (detached before the rest: a copy of the model holds an inert boundary)
        self._entry = module
        self._on_root_forward(module, args, kwargs, entry=True)

    def _on_entry_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or self.detached or self._entry is not module or transformed():
            return
        self._entry = None
        self._on_root_output(module, args, output)

    def _traced_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """The root's forward pre-hook while Dynamo traces it: Dynamo replays this after every
        compiled call (the probe's mark); torch.export traces the model once, and the eager
        run goes on: never latched into "compiled" by it."""
        if not is_exporting():
            self.probe.seen = True
            if (
                self._traced is not None
                and torch.is_grad_enabled()
                and (module.training or self._trains_in_eval)
            ):
                self._traced.note_inputs(args, kwargs)  # for a replay of this step

    @guarded("root forward pre-hook", locked=True, compiling=_traced_forward)
    def _on_root_forward(
        self, module: nn.Module, args: Any, kwargs: Any, entry: bool = False
    ) -> None:
        """The root module's forward begins (or an entry call's, `entry`): the step has
        begun; its inputs are kept for a replay. The torch hook itself (one frame with its
        guard: the unsampled step's path, issue 37)."""
        if self._hooks.replaying:
            return
        # jit.trace, vmap, export: no training step, hookprof steps aside. The verdict is
        # kept for this call's output hook (transformed() asked once per forward, not twice)
        self._in_transform = not entry and transformed()
        if self._in_transform:
            return
        # evaluation passes (under no_grad / inference_mode, or with the model in eval mode
        # unless the run trains in eval mode) are not training steps
        grad = torch.is_grad_enabled()
        if grad:
            if module.training:
                self._train_mode_seen = True
            else:
                self._eval_grad_seen = True
        training = grad and (module.training or self._trains_in_eval)
        self._hooks.root_forward_began(training)
        if not training:
            self._events.on_eval_forward()
            return
        if not entry and self._entry_handles.members:
            self._drop_entry_hooks()  # the root's own forward runs: it is the step's forward
        now = self._clock()
        self._root_seen = True
        first_step = False
        step = self._step
        if not step.forward_seen:
            step.forward_seen = True
            step.closed_by_optimizer = False
            if step.start_ns is None:  # the first step begins
                step.start_ns = now
                first_step = True
        self._events.on_forward(
            module,
            args,
            kwargs,
            entry=entry,
            own_layer=None if entry else self._root_layer,
            now=now,
            first_step=first_step,
        )
        step.forwards += 1
        if step.forwards == MAX_FORWARDS_PER_STEP:
            self._events.on_no_step_signal()

    def _traced_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward hook while Dynamo traces it: the output check, inside the graph."""
        if (
            self._traced is not None
            and torch.is_grad_enabled()
            and (module.training or self._trains_in_eval)
        ):
            self._traced.note_output(output)

    @guarded("root forward hook", locked=True, compiling=_traced_output)
    def _on_root_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root module's forward returned: its output is checked (every step), inside
        the graph when the model runs compiled."""
        if self._in_transform:  # (its pre-hook's verdict; cleared for an enclosing call)
            self._in_transform = False
            return
        if self._hooks.replaying:
            return
        training = self._hooks.root_output_arrived()
        if not training or not torch.is_grad_enabled():
            return
        self._events.on_output(output)

    # ---------------- the update ----------------

    def _traced_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer hook while Dynamo traces it (a compiled optimizer step): nothing to do
        inside its graph."""
        return None

    @guarded("optimizer pre-hook", locked=True, compiling=_traced_update)
    def _on_optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """An optimizer is about to update: the gradients are final, the parameters still
        this step's (the last moment for a replay). With a closure (LBFGS, Lightning's
        automatic optimization, sharpness-aware optimizers) the step's forward and backward
        have not run yet: they run inside the closure, so the closure is wrapped and the
        gradients are read after each call of it. (Detached: from another thread, or while
        this step was in progress, the dispatcher may call a listener once more after it
        left: the guard returns.)"""
        # owns(), its usual case inline (every step): the optimizer's answer cached while
        # its parameter groups keep their sizes
        cached = self._owned.get(optimizer)
        owned = (
            cached[1]
            if cached is not None
            and cached[0] == sum(map(len, map(_PARAMS, optimizer.param_groups)))
            else self.owns(optimizer)
        )
        self._last_owned = (optimizer, owned)  # the post-hook's answer too (no second lookup)
        if not owned:
            return None
        # args are those of the unbound step: (optimizer, closure?, ...)
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if callable(closure):  # (its forwards run inside: judged as the closure returns)
            self._events.on_update_began(optimizer, final=False)
            wrapped = self._wrap_closure(closure, optimizer)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        if (
            self._train_mode_seen and not self._trains_in_eval
        ):  # _judge_eval_mode's usual case, inline
            self._train_mode_seen = self._eval_grad_seen = False
        elif self._train_mode_seen or self._eval_grad_seen:  # (else it has nothing to judge)
            self._judge_eval_mode()
        if self._step.forward_seen or not self._root_seen:  # in_step(), inline: every step
            self._step.stepped = True
            self._events.on_update_began(optimizer, final=True)  # (and its gradients read)
        else:
            self._events.on_update_began(optimizer, final=False)
            if self._step.closed_by_optimizer:  # a later optimizer of the step an earlier one ended
                self._events.on_later_update(optimizer)
        return None

    def _wrap_closure(
        self, closure: Callable[[], Any], optimizer: torch.optim.Optimizer
    ) -> Callable[[], Any]:
        judged = self._events.closure_judged(optimizer)

        def closure_then_read() -> Any:
            if self.detached:  # detached (from another thread) during this optimizer step
                return closure()
            self._step.forwards = 0  # LBFGS calls it thousands of times in one step
            self._closure_called(judged)
            result = closure()  # the user's: what it raises is theirs
            self._closure_returned(optimizer, judged)  # (nothing once detached: guarded, locked)
            return result

        return closure_then_read

    @guarded("optimizer closure", locked=True)
    def _closure_called(self, judged: bool) -> None:
        self._events.on_closure_call(judged)

    @guarded("optimizer closure", locked=True)
    def _closure_returned(self, optimizer: torch.optim.Optimizer, judged: bool) -> None:
        # called once or several times (LBFGS); the parameters are still this step's
        self._events.on_back_in_optimizer()
        self._judge_eval_mode()
        if self.in_step():
            self._step.stepped = True
            self._events.on_closure_returned(optimizer, judged)

    def _judge_eval_mode(self) -> None:
        """An owned update: do the forwards since the last one say the run trains in eval
        mode? Only eval-mode forwards with gradients: yes (this update ends a step, its
        forward unrecorded); a train-mode forward: no (from then on an eval-mode forward is
        an evaluation again); no forward at all (a second optimizer of the step): unchanged."""
        if self._train_mode_seen:
            self._trains_in_eval = False
        elif self._eval_grad_seen and not self._trains_in_eval:
            self._trains_in_eval = True
            if not self._step.forward_seen:  # this window is a step (its forward went unrecorded)
                self._step.forward_seen = True
                self._step.closed_by_optimizer = False
                self._root_seen = True
            if self._say is not None:
                self._say("trains in eval mode", trains_in_eval_notice(self._model_type))
        self._train_mode_seen = self._eval_grad_seen = False

    @guarded("optimizer hook", locked=True, compiling=_traced_update)
    def _on_optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer's update returned: an owned one ends the step, unless prof.step()
        ends steps."""
        last = self._last_owned
        owned = last[1] if last[0] is optimizer else self.owns(optimizer)
        self._last_owned = (None, False)  # (never holds an optimizer past its step)
        # only the post-hook of the step in progress: a subclass calling super().step()
        # runs the hooks twice when both classes were patched by torch, the outer one
        # after this hook ended the step
        ends = (
            owned and not self.manual and (self._step.forward_seen or not self._root_seen)
        )  # (in_step(), inline)
        # (the guard's, for any optimizer; `returned`: an owned one's, the step goes on)
        self._events.on_any_update_done(owned, returned=owned and not ends)
        if ends:
            self._end_step(None, by_optimizer=True)  # the optimizer phase ends with it

    def _on_scaler_decision(self, optimizer: torch.optim.Optimizer, skipped: bool) -> None:
        """A GradScaler decided an optimizer's step: a skip (its gradients overflowed) ends
        the step as a skipped one, as the optimizer's own step would have ended it. A step,
        not an incident, unless skips go on for more than max_skipped_steps in a row."""
        if not skipped or self.detached:
            return
        self._scaler_skip(optimizer)

    @guarded("GradScaler hook", locked=True)
    def _scaler_skip(self, optimizer: torch.optim.Optimizer) -> None:
        if self.in_step() and self.owns(optimizer):
            if self.manual:
                self._step.scaler_skipped = True  # prof.step() ends it
            else:
                self._end_step(None, by_optimizer=True, skipped=True)

    # ---------------- the step's end ----------------

    @guarded("step boundary", locked=True)
    def step(self, loss: Any) -> None:
        """`prof.step(loss)`: from its first call on, only these calls end steps. (Its own
        end of the step: `_end_step`'s body, inline, one frame less on every such step.)"""
        self.manual = True
        step = self._step
        if step.closed_by_optimizer and not step.forward_seen:
            # the optimizer hook already ended this step: this call adds its loss
            step.closed_by_optimizer = False
            self._events.on_late_loss(loss)
            return
        number, now = self._events.on_step_end(  # (its loss checked first)
            loss,
            skipped=step.scaler_skipped and not step.stepped,
            started_ns=step.start_ns,
            forward_seen=step.forward_seen,
        )
        self._step = StepState(start_ns=now)
        if not self.detached:  # (detached by this thread meanwhile: nothing to plan)
            self._events.on_step_ended(number, now)

    def _end_step(self, loss: Any, *, by_optimizer: bool, skipped: bool = False) -> None:
        """An optimizer's update ended the step (or a GradScaler's skip of it): called
        holding the lock, from the guarded hooks (`step` ends its own the same way)."""
        if self.detached:  # detached (or a copy's inert boundary): nothing to end
            return
        number, now = self._events.on_step_end(
            loss,
            skipped=skipped,
            started_ns=self._step.start_ns,
            forward_seen=self._step.forward_seen,
        )
        self._step = StepState(start_ns=now, closed_by_optimizer=by_optimizer)
        if not self.detached:  # (detached by this thread meanwhile: nothing to plan)
            self._events.on_step_ended(number, now)


def _inert() -> StepBoundary:
    """What a copy of an attached model (copy.deepcopy, pickling: EMA and SWA copies,
    whole-model checkpoints) holds in place of the boundary: the root hooks, copied with the
    model's hook dicts, find it detached and do nothing. Only the original is profiled."""
    inert = StepBoundary.__new__(StepBoundary)
    inert.detached = True
    return inert
