"""Per-layer instrumentation, installed only for sampled steps.

Forward: each layer's `forward` is wrapped for the step (an instance attribute that detach
and unsampled steps remove again), so one Python frame times the call and (optionally)
takes two device-side reductions of the output. A wrapper costs ~3 us less per call than a
forward pre/post hook pair: hooks send every call through `nn.Module`'s slow path. The root
module, when it is a layer itself, keeps a hook pair (its call may already be under way when
the hooks go in), and so does a module with forward hooks of its own (one may replace the
output that hookprof has to see).

Backward, without full module backward hooks (DESIGN.md invariant 1): a pre-hook on the
autograd node of each output marks when the gradient reaches the layer, one on the node of
each input marks when the layer has produced its input gradient. Layers whose inputs need no
gradient (the first layer) end at their parameters' gradient accumulation instead. During
the root module's training forward the nodes are noted and their pre-hooks registered in one
go when it returns (mark_pending).

Nothing here reads a device value; everything is appended to the step's StepRecord and
resolved later by the publisher thread.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from hookprof.compiled import compiled_regions, is_compiling, transformed
from hookprof.device.timing import Timer
from hookprof.faults import Faults
from hookprof.handles import Handle, HandleGroup
from hookprof.layers import LayerTable
from hookprof.step.builtin_statistics import BUILT_IN
from hookprof.step.record import ROOT_INPUT, Activation, Call, StepRecord
from hookprof.step.statistics import OUTPUT, applies, source_of, values_of
from hookprof.tensors import iter_tensors, output_checksum, summable

_Tensor = torch.Tensor
_NO_ATTRIBUTE = object()  # a module without an instance attribute `forward` of its own

# -1 unless the autograd engine runs a backward pass on this thread: a forward call then is
# a recomputation (torch.utils.checkpoint, reentrant or not)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its own counter, bumped for every graph,
    fullgraph or not: its "frames" count misses fullgraph=True; torch._dynamo is loaded
    wherever a compiled region exists, and is not imported here for the others)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["stats"]["unique_graphs"] if utils is not None else 0


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's real view (its NaN/Inf and the size of its parts; aminmax refuses
    complex input, issue 39); any other tensor itself."""
    return torch.view_as_real(t) if t.is_complex() else t


class ForwardWrapper:
    """A layer's `forward` while it is instrumented: times the call around the module's own
    forward. Copies of the module (deepcopy, pickle: EMA models, checkpoints of the whole
    module) get the module's own forward back, never one that runs the original module."""

    __slots__ = ("_enter", "_end", "_layer", "__wrapped__", "prior")

    def __init__(self, enter: Any, end: Any, layer_index: int, forward: Any, prior: Any = None):
        self._enter = enter
        self._end = end  # LayerHooks._end: the call's end, for a call _enter recorded
        self._layer = layer_index
        self.__wrapped__ = forward  # inspect.signature() follows it to the module's own
        # the module's instance attribute `forward` it replaced; None: there was none (the
        # class's forward ran), so a copy of the module has none either (step/copies.py)
        self.prior = prior

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.__wrapped__
        if not self._enter(self._layer, args, kwargs):
            return forward(*args, **kwargs)
        try:
            output = forward(*args, **kwargs)
        except BaseException:
            self._end(self._layer, None)
            raise
        self._end(self._layer, output)
        return output

    def __deepcopy__(self, memo: dict) -> Any:
        # copying the module: its copy calls its own forward (bound to the copy, through memo)
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__wrapped__.__reduce__()


def wrap_attribute(target: Any, attribute: str, row: int, enter: Any, end: Any) -> Handle | None:
    """Put a ForwardWrapper of `row` in place of `target`'s `attribute`; the handle that takes
    it out again, or None when the object refuses it. Taking it out restores only our own
    attribute: one set over ours since is left alone (our wrapper inside it then calls
    through), so wrappers of several owners come out in the reverse order they went in."""
    prior = target.__dict__.get(attribute, _NO_ATTRIBUTE)
    wrapper = ForwardWrapper(
        enter, end, row, getattr(target, attribute), None if prior is _NO_ATTRIBUTE else prior
    )
    try:
        setattr(target, attribute, wrapper)
    except Exception:
        return None
    return Handle(partial(_unwrap, target, attribute, wrapper, prior))


def _unwrap(target: Any, attribute: str, wrapper: ForwardWrapper, prior: Any) -> None:
    if target.__dict__.get(attribute) is wrapper:
        if prior is _NO_ATTRIBUTE:
            delattr(target, attribute)
        else:
            setattr(target, attribute, prior)


class LayerHooks:
    """The per-layer instrumentation of sampled steps. It stays installed across consecutive
    sampled steps (only the record changes) and is removed for unsampled ones."""

    def __init__(
        self,
        table: LayerTable,
        timer: Timer,
        faults: Faults,
        activation_stats: bool,
        root: torch.nn.Module | None = None,
        statistics: tuple[Any, ...] = (),
    ):
        self._table = table
        self._timer = timer
        self._faults = faults
        # weakly, like the layer table: the model's life is its owner's business
        self._root_ref = weakref.ref(root) if root is not None else None
        self._activation_stats = activation_stats  # per step: begin(activation_stats=...)
        # per row, the per-layer statistics of outputs that reduce it (step/statistics.py:
        # hookprof's built-in ones and the user's), with their index among all; none for a
        # container's row (hooked by a replay, and not a row the aggregator keeps)
        outputs = [(k, stat) for k, stat in enumerate(statistics) if source_of(stat) == OUTPUT]

        def report(part: str, exc: BaseException) -> None:
            faults.report(part, exc, disable=False)  # (that statistic's loss alone)

        # and whether it is one of hookprof's own: their results need no values_of check
        # (they return 0-d tensors and floats, tested in test_statistic_parts.py), ~1 us an
        # output less
        self._statistics: list[list[tuple[int, Any, bool]]] = [
            [
                (k, stat, any(stat is own for own in BUILT_IN))
                for k, stat in outputs
                if applies(stat, layer.module, report)
            ]
            for layer in table.layers
        ] + [[] for _ in table.containers]
        # what is installed, as handles: hook handles (the root layer, modules that refuse a
        # wrapper) and wrappers put in place (a layer's `forward`, a compiled region's
        # compiled call: see _wrap); a replay's additions go in a group of their own. Read,
        # not written, from outside: `installs.members` is `installed` without its call (a
        # step's start asks it, every step)
        self.installs = HandleGroup()
        self._group = self.installs  # where an install goes now
        self._skipped: list[int] = []  # layers left out: their calls run inside a compiled graph
        # the compiled regions with children (see _install_regions): row -> every parameter
        # of the module, where its backward ends when its inputs need no gradient; and
        # whether some layer's calls are seen by no hook (their statistics: a re-run)
        self._region_params: dict[int, list[torch.nn.Parameter]] = {}
        self._hides = False
        self._rec: StepRecord | None = None
        self._local = threading.local()  # each thread's stack of open forward calls
        # the three states below change only through the methods that say what happened:
        # a forward replayed under no_grad to find a NaN's producer (replaying_into)
        self.replaying = False
        # a replay check's step (hookprof/integrity/replay_check.py): each output's bits are
        # summed into the record, the step's own and its replay's, to compare
        self.fingerprint_outputs = False
        self._paused = False  # inside an evaluation pass of the root module
        # inside the root module's training forward: a region run under no_grad there is a
        # reentrant activation checkpoint's first pass, part of the step
        self._in_training_forward = False
        # called with (layer, args, kwargs, nested) for each training call of a sampled step
        # (set by efficiency.StepEfficiency.listen); never raises
        self.on_call: Any = None

    @property
    def installed(self) -> bool:
        return bool(self.installs.members)

    @property
    def hides_compiled_layers(self) -> bool:
        """Installed, with layers no hook sees: inside a compiled region (a layer compiled on
        its own, without children, is timed and checked as itself)."""
        return self._hides and self.installed

    def activation_stats_off(self) -> None:
        """This step's own calls take no activation statistics (a re-run takes them all)."""
        self._activation_stats = False

    def listen(self, on_call: Any) -> None:
        """Have `on_call(layer, args, kwargs, nested)` told of each training layer call of a
        sampled step (efficiency's FLOP counter); None: nobody. Its owner may change it
        between calls (a first call reads the precision, then the counter is called direct)."""
        self.on_call = on_call

    def begin(
        self, rec: StepRecord, install: bool = True, *, activation_stats: bool | None = None
    ) -> None:
        """Start recording a sampled step into `rec`, installing the hooks if needed; with
        `activation_stats`, switch the per-layer output checks for this step."""
        self._rec = rec
        self._local = threading.local()
        if activation_stats is not None:
            self._activation_stats = activation_stats
        if install:
            self.install()

    def root_forward_began(self, training: bool) -> None:
        """The root module's forward starts: a training pass (grad enabled, train mode) or
        an evaluation pass, which the layer hooks ignore until the next training forward."""
        # marks noted by a forward that raised (no root output hook ran) would keep that
        # forward's graph alive: an out-of-memory retry must find its memory free
        rec = self._rec  # (drop_pending, inline: this runs at every training forward)
        if rec is not None and rec.pending_marks:
            rec.pending_marks = {}
        self._paused = not training
        self._in_training_forward = training

    def root_output_arrived(self) -> bool:
        """The root module's forward returned; True when it was a training pass. The
        backward marks its calls noted are registered now, in one loop."""
        if self._in_training_forward:
            self._in_training_forward = False
            if self._rec is not None:  # a sampled step's (mark_pending has nothing else to do)
                self.mark_pending()
        return not self._paused

    @contextmanager
    def replaying_into(self, rec: StepRecord) -> Iterator[None]:
        """Record a replayed forward into `rec`, with the output checks on (they are what the
        replay is for) and the container modules hooked too (calls numbered after the layers),
        so a NaN made by a container's own code between its children is seen there;
        afterwards the hooks are as they were."""
        installed = self.installed
        stats_were_on = self._activation_stats
        step_rec, step_local = self._rec, self._local  # a sampled step's own, if one is open
        self.replaying = True
        self._activation_stats = True
        added = HandleGroup()  # what the replay adds: its container hooks, skipped layers
        try:
            self.begin(rec)
            if installed and self._skipped:  # the layers inside compiled regions, for the replay
                self._group = added
                self._install_layers([self._table.layers[i] for i in self._skipped])
            first = len(self._table.layers)
            for k, (_, module) in enumerate(self._table.containers):
                if module is None:
                    continue
                added.add(module.register_forward_pre_hook(partial(self._pre, first + k)))
                added.add(
                    module.register_forward_hook(partial(self._post, first + k), always_call=True)
                )
            yield
        finally:
            self._group = self.installs
            try:
                added.remove()
            finally:  # (a wrapper that would not come out must not leave replaying set)
                self.replaying = False
                self._activation_stats = stats_were_on
            if installed:
                self.end()  # the replay's record: its parameter hooks go
                # the sampled step goes on recording (its own hooks are removed at its end)
                self._rec, self._local = step_rec, step_local
            else:
                self.remove()

    def note_root_inputs(self, args: Any, kwargs: Any) -> None:
        """Check the root module's inputs on a step with output checks: a NaN/Inf already in
        them was made by none of the model's modules (its producer is "(input)")."""
        rec = self._rec
        if rec is None or not self._activation_stats:
            return
        try:
            for t in iter_tensors((args, kwargs)):
                if (t.is_floating_point() or t.is_complex()) and t.numel():
                    low, high = torch.aminmax(_real(t.detach()))
                    # known like a layer's output: a layer taking it reuses this reduction
                    rec.out_stats[id(t)] = (weakref.ref(t), t._version, len(rec.act))
                    rec.act.append(Activation(ROOT_INPUT, low, high))
        except Exception as exc:
            self._faults.report("forward pre-hook", exc)

    def install(self) -> None:
        """Instrument every layer, except those whose calls run inside a compiled graph
        (regional compilation: blocks compiled one by one). There a hook times nothing, and
        a wrapper put in or taken out changes what Dynamo guards on: each sampled step
        would recompile every block, until Dynamo gives up and runs it eagerly. A replay
        (eager, under set_stance("force_eager")) instruments them too."""
        if self.installed:
            return
        regions, skipped = ([], set()) if self.replaying else compiled_regions(self._table)
        self._install_layers([layer for layer in self._table.layers if layer.index not in skipped])
        self._skipped = sorted(skipped)
        self._region_params, self._hides = {}, False
        if skipped:
            self._install_regions(regions, skipped)

    def _install_regions(self, regions: list[Any], inside: set[int]) -> None:
        """Time each compiled region (a block compiled on its own) as one call: its compiled
        call is wrapped from outside, where Dynamo does not look (the module's
        `_compiled_call_impl` after module.compile(), or the `forward` of the torch.compile
        wrapper put in its place), so no guard changes and nothing recompiles. Its row is
        the region's layer or container row; its backward is timed by the same node marks as
        a layer's (and, when its inputs need no gradient, ends at its parameters' last
        gradient). A layer without children compiled on its own is seen, and checked, as
        itself; a region with children hides its layers, so a checked step takes their
        statistics, all of them, from a re-run (SampledStep.rerun_wanted: the step's own calls
        check nothing, or the block would be blamed for a NaN one of its layers made), and
        the eager replay names such a NaN layer by layer."""
        seen = set()
        n = len(self._table.layers)
        for region in regions:
            # (a region a wrapper cannot go on is left untimed rather than failing the step)
            if not self._wrap(
                region.target, region.attribute, region.row, self._enter_region, self._end_region
            ):
                continue
            module = self._table.row_module(region.row)
            if (
                region.row < n
                and module is not None
                and next(iter(module.children()), None) is None
            ):
                seen.add(region.row)
            elif module is not None:
                self._region_params[region.row] = list(module.parameters())
        self._hides = bool(inside - seen)

    def _enter_region(self, row: int, args: Any, kwargs: Any = None) -> bool:
        """A compiled region's call begins: recorded as a training call, never in a replay
        (the replay runs eagerly and sees the region's own layers)."""
        if self.replaying:
            return False
        self._local.graphs = _graphs_compiled()
        return self._enter(row, args, kwargs)

    def _end_region(self, row: int, output: Any) -> None:
        """A compiled region's call ended. When Dynamo compiled during it (the region's first
        call, a recompile for a new shape), its time is compilation: the call is kept (its
        FLOPs count) and its times are not (StepRecord.untimed)."""
        compiled = _graphs_compiled() != getattr(self._local, "graphs", None)
        stack = getattr(self._local, "stack", None)
        rec = self._rec
        if compiled and stack and rec is not None:
            rec.untimed.add(stack[-1])
        self._end(row, output)

    def _install_layers(self, layers: list[Any]) -> None:
        for layer in layers:
            module = layer.module
            if module is None:  # the model is gone (its profiler is waiting to be released)
                continue
            root = self._root_ref() if self._root_ref is not None else None
            if module is not root and self._wrap_forward(module, layer.index):
                continue
            # with the keyword arguments: the FLOP counter replays the call with them
            self._group.add(
                module.register_forward_pre_hook(
                    partial(self._pre_with_kwargs, layer.index), with_kwargs=True
                )
            )
            self._group.add(
                module.register_forward_hook(partial(self._post, layer.index), always_call=True)
            )

    def _wrap_forward(self, module: torch.nn.Module, layer_index: int) -> bool:
        if module._forward_hooks:
            # a forward hook may replace the output: hookprof must see what the rest of the
            # model sees, so hookprof's own hook goes after it
            return False
        # (a module type that refuses the attribute gets a hook pair)
        return self._wrap(module, "forward", layer_index, self._enter, self._end)

    def _wrap(self, target: Any, attribute: str, row: int, enter: Any, end: Any) -> bool:
        """Put a ForwardWrapper timing `row` in place of `target`'s `attribute` (a layer's
        forward, a region's compiled call); False when the object refuses it."""
        handle = wrap_attribute(target, attribute, row, enter, end)
        if handle is None:
            return False
        self._group.add(handle)
        return True

    def end(self) -> None:
        """Stop recording (the instrumentation stays for a following sampled step)."""
        rec, self._rec = self._rec, None
        if rec is not None:
            for handle in rec.param_handles:
                handle.remove()
            rec.param_handles.clear()
            rec.pending_marks.clear()  # a forward that raised: its graph is not kept alive

    def remove(self) -> None:
        self.end()
        self.installs.remove()
        self._region_params, self._hides = {}, False
        self._local = threading.local()

    # --- hook bodies: never raise, never return anything, never read a device value ---

    def _pre(self, layer_index: int, module: torch.nn.Module, args: Any) -> None:
        self._enter(layer_index, args)

    # what the layer's pre-hook does, for a call whose hooks were installed mid-call
    start_call = _pre

    def _pre_with_kwargs(
        self, layer_index: int, module: torch.nn.Module, args: Any, kwargs: Any
    ) -> None:
        self._enter(layer_index, args, kwargs)

    def _post(self, layer_index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._leave(layer_index, output)

    def _enter(self, layer_index: int, args: Any, kwargs: Any = None) -> bool:
        """A call begins; True when it is recorded (its end must then be reported)."""
        if is_compiling():  # traced by Dynamo: no clock, no tensor reads, no graph break
            return False
        rec = self._rec
        # the plain flag first: inside the training forward no C call is needed
        if (
            rec is None
            or self._paused
            or self._faults.broken
            or not (self._in_training_forward or torch.is_grad_enabled() or self.replaying)
            or transformed()
        ):  # jit.trace, vmap, export: their calls are no step's
            return False
        try:
            mark = self._timer.mark
            try:
                stack = self._local.stack
            except AttributeError:
                stack = self._local.stack = []
            # the outer marks (hook work included) matter only to a parent call, which must
            # not count our work as its own: a call without an instrumented parent skips them
            entry = Call(layer_index, stack[-1], mark()) if stack else Call(layer_index, -1)
            calls = rec.calls
            call = len(calls)
            calls.append(entry)
            recompute = not self.replaying and _graph_task_id() != -1
            if recompute:
                rec.recompute.add(call)
            elif self.on_call is not None and not self.replaying:
                self.on_call(layer_index, args, kwargs, bool(stack))
            inputs_need_grad = False
            pending = rec.pending_marks
            stats = self._activation_stats and not recompute
            role = call << 1  # an input: the call's backward ends when its gradient is ready
            # forward(x), inline: a call of iter_tensors costs about as much as the loop
            tensors = (
                args
                if type(args) is tuple and len(args) == 1 and isinstance(args[0], _Tensor)
                else iter_tensors(args)
            )
            for t in tensors:
                # non-leaf only: a hook on a leaf (a parameter passed as an input) would
                # outlive the step and survive detach()
                node = t.grad_fn
                if node is not None:
                    inputs_need_grad = True
                    roles = pending.get(node)
                    if roles is None:
                        pending[node] = [role]
                    else:
                        roles.append(role)
                if stats and (t.is_floating_point() or t.is_complex()) and t.numel():
                    self._note_input(rec, t, call)
            if (
                not inputs_need_grad
                and layer_index not in rec.param_hooked
                and (layer_index < len(self._table) or layer_index in self._region_params)
            ):
                self._hook_params(rec, layer_index)
            if recompute or not self._in_training_forward:
                self.mark_pending()
            stack.append(call)
            entry.start = mark()  # last: our own work stays outside the span
            return True
        except Exception as exc:  # invariant 3: count, log once, switch off
            self._faults.report("forward pre-hook", exc)
            return False

    def _leave(self, layer_index: int, output: Any) -> None:
        """A call ended with `output` (None when it raised)."""
        if self._rec is not None and not is_compiling() and not transformed():
            self._end(layer_index, output)  # (under a compile or transform _enter recorded nothing)

    def _end(self, layer_index: int, output: Any) -> None:
        """_leave for a call whose _enter recorded it (so not one Dynamo traces): what the
        forward wrapper calls, one frame and one check less per call."""
        try:
            end = self._timer.mark()  # first: our own work stays outside the span
        except Exception as exc:  # invariant 3 holds for the clock too
            self._faults.report("forward hook", exc)
            return
        rec = self._rec
        if (
            rec is None
            or self._paused
            or self._faults.broken
            or not (self._in_training_forward or torch.is_grad_enabled() or self.replaying)
        ):
            return
        try:
            stack = getattr(self._local, "stack", None)
            if not stack:
                return  # the call began before this step's recording did
            call = stack.pop()
            entry = rec.calls[call]
            entry.end = end
            recompute = call in rec.recompute
            stats = self._activation_stats and not recompute  # seen on the first pass
            if stats:
                rec.ended.append(call)
            pending = rec.pending_marks
            role = call << 1 | 1  # an output: the call's backward starts when its gradient is ready
            # (the check step's training forward, or its replay: not a layer the loop calls
            # outside the root's forward, which a replay of that forward never calls)
            fingerprints = (
                self.fingerprint_outputs
                and not recompute
                and (self._in_training_forward or self.replaying)
            )
            for t in (output,) if isinstance(output, _Tensor) else iter_tensors(output):
                node = t.grad_fn
                if fingerprints and summable(t):
                    rec.fingerprints.append((call, output_checksum(t)))  # a replay check's step
                if stats and (t.is_floating_point() or t.is_complex()) and t.numel():
                    d = _real(t.detach())
                    # device-side reductions, kept on the device. aminmax gives max |x| over
                    # the whole output in one pass, and NaN/Inf propagate, so it doubles as
                    # the exact non-finite detector; statistics of source "extremes" (the
                    # abs max) are folded from these values, with nothing done here
                    low, high = torch.aminmax(d)
                    rec.out_stats[id(t)] = (weakref.ref(t), t._version, len(rec.act))
                    rec.act.append(Activation(call, low, high))
                    # the statistics of outputs (step/statistics.py), hookprof's and the
                    # user's, inline: one loop per output of a sampled step
                    for k, stat, own in self._statistics[layer_index]:
                        try:
                            values = stat.reduce(d)
                            if not own:
                                values = values_of(stat, values)
                            rec.stats.append((k, call, values))
                        except Exception as exc:  # that statistic, that call, alone
                            self._faults.report(f"layer statistic {stat.name}", exc, disable=False)
                if node is not None:
                    roles = pending.get(node)
                    if roles is None:
                        pending[node] = [role]
                    else:
                        roles.append(role)
            if recompute or not self._in_training_forward:
                self.mark_pending()
            if entry.parent >= 0:
                entry.outer_end = self._timer.mark()
        except Exception as exc:
            self._faults.report("forward hook", exc)

    def _note_input(self, rec: StepRecord, t: torch.Tensor, call: int) -> None:
        """Finiteness of a call's input, to tell the layer that produced a NaN (finite inputs,
        non-finite output) from the ones it flowed through. Reuses the reduction of the layer
        that output t when there was one (same tensor, same version)."""
        known = rec.out_stats.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            rec.inputs.append((call, known[2]))
            return
        low, high = torch.aminmax(_real(t.detach()))
        rec.inputs.append((call, len(rec.act)))
        rec.act.append(Activation(-1, low, high))

    def _hook_params(self, rec: StepRecord, layer_index: int) -> None:
        """The call's backward ends at its parameters' last gradient: a layer's own, or for a
        compiled region every parameter of the module (its inputs needed no gradient). A
        hook on the parameter's gradient as it is computed, not on its accumulation into
        .grad: training through torch.autograd.grad (meta-learning, gradient penalties,
        gradients put into .grad by hand) accumulates nothing, and such a layer had 0
        backward calls (issue 39)."""
        rec.param_hooked.add(layer_index)
        params = self._region_params.get(layer_index)
        if params is None:
            params = [self._table.params[i] for i in self._table.layers[layer_index].param_indices]
        for p in params:
            if p.requires_grad:
                rec.param_handles.append(
                    p.register_hook(partial(self._param_done, rec, layer_index))
                )

    def mark_pending(self) -> None:
        """Register the noted backward marks, one node pre-hook per autograd node: at the end
        of the root module's training forward (one loop rather than one per layer call:
        between matmuls the same Python work costs about twice as much), or at once for calls
        outside it. A pre-hook on the node that produced a tensor runs when its gradient is
        ready, as a tensor hook would, for ~2 us less. The calls noted the roles of each node
        as they went (one layer's output node is the next one's input node), so what is
        left here is one registration per node; holding the nodes until here keeps each
        one's identity (and so the grouping of roles) exact; the graph holds them anyway."""
        rec = self._rec
        if rec is None or not rec.pending_marks:
            return
        try:
            pending, rec.pending_marks = rec.pending_marks, {}
            ready = self._grad_ready
            for node, roles in pending.items():
                node.register_prehook(partial(ready, rec, roles))
        except Exception as exc:
            self._faults.report("forward hook", exc)

    def drop_pending(self) -> None:
        """Forget marks a forward noted but never registered (it raised)."""
        rec = self._rec
        if rec is not None and rec.pending_marks:
            rec.pending_marks = {}

    def _grad_ready(self, rec: StepRecord, roles: list[int], grad: Any) -> None:
        try:
            rec.grad_ready.append((roles, self._timer.mark()))  # roles are expanded off-thread
        except Exception as exc:
            self._faults.report("backward hook", exc)

    def _param_done(self, rec: StepRecord, layer_index: int, grad: torch.Tensor) -> None:
        if self.replaying:  # (a spike replay's backward takes the parameters' gradients)
            return
        try:
            rec.param_done.append((layer_index, self._timer.mark()))
        except Exception as exc:
            self._faults.report("gradient hook", exc)


def own_param_hook(hook: Any) -> bool:
    """Is a parameter's gradient hook (a value of its `_backward_hooks`) a sampled step's
    own (`LayerHooks._param_done`), not the loop's?"""
    return isinstance(hook, partial) and (
        getattr(hook.func, "__func__", None) is LayerHooks._param_done
    )
