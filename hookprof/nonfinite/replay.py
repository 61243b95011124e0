"""The forward replay: naming the layer behind a NaN/Inf on a step without per-layer checks.

Every training forward keeps a reference to the root module's inputs and the RNG state at
its start (a few microseconds). Its output check (one flag, read without waiting) tells
whether the step's output went non-finite; if it did, the same forward runs once more under
`torch.no_grad()` with the per-layer checks installed, the same RNG state (so dropout draws
the same masks) and the same, not yet updated, parameters. Buffers (BatchNorm's running
statistics, a layer's constant `scale`) are swapped for clones while it runs, so the replay
neither changes them nor bumps the version counter of tensors autograd saved for the step's
backward (an in-place restore did, and the user's backward then raised); the RNG is put back
afterwards. Training goes on exactly as it would have. This happens at most once per run.

On an accelerator the flag is usually not on the host before the update: the host runs
ahead of the device. When the update guard holds a non-finite step's update back on the
device (on_nonfinite "skip"/"raise" with a fused optimizer, see guard.py), the weights stay
finite, so the step's inputs are kept (`keep_late`, at most MAX_LATE steps) until its flag
arrives, and the replay runs then, on the weights of a few finite updates later. A kept step
whose update was not held back (a non-fused optimizer without nonfinite_sync: `unheld`) is
never replayed late: if it was non-finite, its update reached the weights, and a replay on
them names the first layer with weights, not the producer. The incident then stays not
localised, and `say` tells why, once.
"""

from __future__ import annotations

import contextlib
import operator
import random
import sys
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from hookprof.device import transfer
from hookprof.device.transfer import Copy
from hookprof.step.hooks import LayerHooks
from hookprof.step.record import StepRecord
from hookprof.tensors import iter_tensors, map_tensors

MAX_LATE = 8  # steps whose output flag may still be on its way (the device's lag), kept

# why a non-finite step was not replayed (NonFiniteEvent.replay_note)
UNHELD = (
    "its update reached the weights before the device said the step was bad (the device "
    "runs behind the host), so a replay would run on non-finite weights; nonfinite_sync=True, "
    "or a fused optimizer (fused=True) under on_nonfinite='skip' or 'raise', holds such an "
    "update back and replays the step"
)
BEHIND = (
    "its output's flag was still on the device when the optimizer applied the step's update "
    "(the device runs behind the host); nonfinite_sync=True waits for the flag and replays the "
    "step in time"
)
NO_CAPTURE = "no training forward of the model was seen on that step to replay"
LATER_WEIGHTS = (
    "its forward was replayed only after later updates had changed the weights (the device "
    "runs behind the host), and was finite there: not the same weights, so neither "
    "reproducible nor transient; nonfinite_sync=True replays the step on its own weights"
)
COMPILED_RNG = (
    "the step's forward ran compiled and draws random numbers (dropout): the eager replay "
    "draws other ones than a backend generating its own (inductor) did, so a finite replay "
    "does not make it transient"
)
INPUTS_CHANGED = (
    "its inputs were changed in place after its forward began (by the forward itself, as "
    "normalising code does with `x /= ...`, or by the loop since): a replay would run on other "
    "inputs than the step's, so its verdict would say nothing of the step"
)
EARLIER_FORWARD = (
    "the NaN/Inf was in an earlier forward of the step (gradient accumulation, a model "
    "called several times per step); the replay covers the step's last forward only"
)


class RngState(NamedTuple):
    """The CPU generator's state, and every CUDA device's (None: CUDA not in use)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None


def rng_state(cuda: bool | None = None) -> RngState:
    """The CPU generator's state and, with CUDA in use (`cuda` None: once it is initialized),
    every CUDA device's: what a replay starts its forward from."""
    if cuda is None:
        cuda = torch.cuda.is_initialized()
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)


def set_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)


def forward_modes() -> dict[str, Any]:
    """Grad mode and autocast as a training forward starts: the replay, which runs later
    (at the update, outside the loop's `autocast` block), runs in them again, or an fp16
    overflow would replay in fp32 and read transient. Two C calls per forward."""
    modes: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled(), "autocast": {}}
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            modes["autocast"][device_type] = str(
                torch.get_autocast_dtype(device_type)
            ).removeprefix("torch.")
    return modes


def autocast_of(modes: dict[str, Any] | None) -> contextlib.ExitStack:
    """The autocast a forward ran in (forward_modes), entered again."""
    stack = contextlib.ExitStack()
    for device_type, dtype in ((modes or {}).get("autocast") or {}).items():
        stack.enter_context(torch.autocast(device_type=device_type, dtype=getattr(torch, dtype)))
    return stack


def eager() -> Any:
    """A context in which compiled modules and functions run their Python eagerly."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _drew_random_numbers(captured: CapturedForward) -> bool:
    """Did the replayed forward draw from the RNG it was started with (its state moved)?"""
    if not torch.equal(torch.get_rng_state(), captured.cpu_rng):
        return True
    if captured.cuda_rng is not None:
        return any(
            not torch.equal(now, then)
            for now, then in zip(torch.cuda.get_rng_state_all(), captured.cuda_rng)
        )
    return False


class KeptStep(NamedTuple):
    """A step whose output flag was still on its way at its update (ForwardReplay.kept):
    its flag and its earlier forwards', and its inputs when a late replay may need them."""

    step: int
    flag: Copy
    captured: CapturedForward | None
    earlier: Copy | None


def own_weights_nonfinite(layers: list[Any]) -> list[torch.Tensor]:
    """One 0-d flag per layer (layers.Layer, in table order): do its own parameters hold a
    NaN/Inf now? Sent with the replay's record (no wait): a layer whose own weights are
    non-finite makes a NaN from finite inputs without being where it began (the weights took
    a non-finite update earlier), so aggregate names it no producer. Parameters only: buffers
    such as BatchNorm's running stats are written by the bad forward itself, before the
    replay looks, and say nothing of an earlier update."""
    flags = []
    for layer in layers:
        module = layer.module
        own = (
            []
            if module is None
            else [
                t if not t.is_complex() else torch.view_as_real(t)
                for t in module.parameters(recurse=False)
                if (t.is_floating_point() or t.is_complex()) and t.numel()
            ]
        )
        if not own:
            flags.append(torch.zeros((), dtype=torch.int64))
            continue
        device = own[0].device
        # isfinite, not a sum: a sum of large finite weights can overflow
        finite = torch.stack(
            [torch.isfinite(t.detach()).all().to(device, non_blocking=True) for t in own]
        )
        flags.append(finite.logical_not().any().to(torch.int64))
    return flags


_VERSION = operator.attrgetter("_version")


def input_versions(args: tuple, kwargs: dict | None) -> int | tuple[int, ...]:
    """The version counters of a forward's input tensors: an in-place edit of one (`x /= 2`,
    `x.relu_()`) bumps its counter. One int for the usual `forward(x)`."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
        return args[0]._version
    return tuple(map(_VERSION, iter_tensors((args, kwargs))))


class CapturedForward:
    """One training forward as the replay needs it: what was called (None: the model), with
    what, and the RNG state at its start. Handed to `_run` as a whole, so replaying a kept
    step never swaps the current step's capture out and back (an exception in between
    would leave the kept step's in its place)."""

    __slots__ = (
        "module",
        "args",
        "kwargs",
        "cpu_rng",
        "cuda_rng",
        "updates",
        "modes",
        "compiled",
        "versions",
    )

    def __init__(
        self,
        module: nn.Module | None,
        args: tuple,
        kwargs: dict | None,
        cpu_rng: torch.Tensor,
        cuda_rng: list[torch.Tensor] | None,
        updates: int = 0,
        modes: dict | None = None,
        versions: int | tuple[int, ...] | None = None,
    ):
        self.module, self.args, self.kwargs = module, args, kwargs
        self.cpu_rng, self.cuda_rng = cpu_rng, cuda_rng
        self.updates = updates  # updates applied to the weights before this forward
        self.modes = modes  # grad mode and autocast at its start (forward_modes)
        self.compiled = False  # it ran compiled (its RNG state was taken at the step's start)
        # the inputs' version counters as the forward began (input_versions; None: unknown)
        self.versions = versions

    def changed_in_place(self) -> bool:
        """Was an input tensor edited in place since the forward began (by the forward
        itself, or by the loop since)? Then a replay would not run on the step's inputs."""
        return self.versions is not None and input_versions(self.args, self.kwargs) != self.versions


class ForwardReplay:
    """The replay's state: the captured forward, this step's output flag, and whether the
    one replay of the run has happened (`enabled=False`: never, e.g. under DTensor)."""

    def __init__(
        self,
        model: nn.Module,
        enabled: bool = True,
        keep_late: bool = False,
        say: Callable[[str, str], None] | None = None,
        witness: Any = None,
    ):
        self._model_ref = weakref.ref(model)  # weakly: see layers.Layer.module_ref
        # capsule.Capsules when Config.capsule_dir is set: it watches the one replay and
        # keeps what it used (`watch`), and the forward's modes are kept for it (`modes`)
        self._witness = witness
        self.captured: CapturedForward | None = None  # this step's last training forward
        self.done = not enabled
        # (host flag, ready event) of this step's output check, not looked at yet
        self.flag: Copy | None = None
        # ... and of the step's earlier forwards (gradient accumulation, a model called twice)
        self._earlier: Copy | None = None
        self.updates = 0  # updates applied to the weights so far (`updated`)
        self.moved = 0  # updates applied between the last replayed forward and its replay
        self.keep_late = keep_late
        # (step, flag, its forward, the earlier forwards' flag) of steps whose flags are on
        # their way (forward None: it cannot be replayed, see `unheld` and `run_if_bad`);
        # `flag`, `kept` and `refused` are read by NonfiniteChecks at every step, as
        # attributes (a property is one more Python call each time)
        self.kept: deque[KeptStep] = deque(maxlen=MAX_LATE)
        self._say = say
        # (step, why) of non-finite steps that could not be replayed, for the publisher
        # (the first NaN is then "not replayed", with the reason, never "not yet localised")
        self.refused: list[tuple[int, str]] = []
        # why the replay that ran cannot call a finite result transient (None: it can)
        self.caveat: str | None = None

    @property
    def model(self) -> nn.Module | None:
        """The model (None once it is gone: it is held weakly)."""
        return self._model_ref()

    def may_replay(self, step: int) -> bool:
        """Can a late replay still run for a step up to `step` (a kept step whose update was
        held back, its flag not looked at yet)?"""
        return not self.done and any(s <= step and c is not None for s, _, c, _ in self.kept)

    def unheld(self, step: int) -> None:
        """`step`'s update was not held back (guard.UpdateGuard.unguarded): if its flag says
        non-finite, the weights have taken that update, so its forward is not replayed."""
        if self.kept and self.kept[-1].step == step:
            self.kept[-1] = self.kept[-1]._replace(captured=None)

    def updated(self) -> None:
        """An update reached the weights (not held back, not skipped): a forward captured
        before it replays on other weights from now on."""
        self.updates += 1

    def capture(
        self,
        args: tuple,
        kwargs: dict,
        module: nn.Module | None = None,
        rng: RngState | None = None,
        *,
        also_when_done: bool = False,
    ) -> CapturedForward | None:
        """Keep a training forward's inputs: of the root, or of the entry call `module` (a
        child of the root, when the loop never calls the root itself); `rng`: the RNG state
        at its start when that was earlier than now (a compiled forward, kept afterwards).
        Returns what it kept; once the run's replay is done, nothing, unless
        `also_when_done` (a sampled step's re-run wants it: built, not kept)."""
        if self.done and not also_when_done:
            return None
        compiled = rng is not None  # a compiled forward's, taken at the step's start
        if rng is None:  # rng_state(), inline: every training forward
            rng = RngState(
                torch.get_rng_state(),
                torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            )
        # the inputs' versions (input_versions, its usual case inline: every training forward)
        versions = (
            args[0]._version
            if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor
            else input_versions(args, kwargs)
        )
        # forward_modes(), inline (every training forward): grad mode and autocast
        modes: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled(), "autocast": {}}
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                modes["autocast"][device_type] = str(
                    torch.get_autocast_dtype(device_type)
                ).removeprefix("torch.")
        captured = CapturedForward(
            module, args, kwargs, rng.cpu, rng.cuda, self.updates, modes, versions
        )
        captured.compiled = compiled
        if not self.done:
            self.captured = captured
        return captured

    def clear(self) -> None:
        self.captured = None

    def note_output(
        self, flag: bool | torch.Tensor | None, earlier: bool | torch.Tensor | None = None
    ) -> bool:
        """This forward's output check, and the step's earlier forwards' (None: this is the
        step's first), as their owner combined them (output.OutputFlags: the replay reads
        them, never stacks them again). True when this one is already known bad on the host:
        the replay can run at once. Device flags are peeked at, to be read when their copies
        have completed (`run_if_bad`)."""
        if self.done:
            return False
        self._earlier = (
            None
            if earlier is None or earlier is False
            else Copy(True, None)
            if earlier is True
            else transfer.peek(earlier)
        )
        if flag is True:
            self.flag = Copy(True, None)
            return True
        if isinstance(flag, torch.Tensor):
            self.flag = transfer.peek(flag)
        return False

    def run_if_bad(
        self,
        hooks: LayerHooks,
        new_record: Callable[[], StepRecord],
        step: int = 0,
        wait: bool = False,
    ) -> StepRecord | None:
        """If this step's output went non-finite, replay its forward into a new record and
        return it; None when it did not, when its flag is not on the host yet (waited for
        only with `wait`, Config.nonfinite_sync; else kept for `run_late` under keep_late),
        or when there is nothing to replay."""
        flag, self.flag = self.flag, None
        earlier, self._earlier = self._earlier, None
        if flag is None:
            return None
        if wait and not self.done:
            for f in (flag, earlier):
                if f is not None and not transfer.is_ready(f[1]):
                    transfer.wait_ready(f.ready)  # the opt-in wait (unless the guard's did it)
        ready, earlier_ready = flag.ready, None if earlier is None else earlier.ready
        # (_ready, inline: asked at every step on a device)
        if (ready is not None and not ready.query()) or (
            earlier_ready is not None and not earlier_ready.query()
        ):
            if not self.done:
                # kept until the flags arrive: replayed then when its update is held back
                # (keep_late), else only said to be beyond a replay if it turns out bad
                self.kept.append(
                    KeptStep(step, flag, self.captured if self.keep_late else None, earlier)
                )
            return None
        if not bool(flag.host):  # a host value (or a completed copy)
            if earlier is not None and bool(earlier.host) and not self.done:
                self._refuse(step, EARLIER_FORWARD)
            return None
        if self.captured is None:
            self._refuse(step, NO_CAPTURE)
            return None
        rec = new_record()
        return rec if self._run(hooks, rec, self.captured, step) else None

    def run_late(
        self, hooks: LayerHooks, new_record: Callable[[], StepRecord]
    ) -> tuple[int, StepRecord] | None:
        """The first kept step whose flag has arrived and says non-finite: its forward is
        replayed (on the current weights, finite since its update was held back). Returns
        (its step, the record). Never waits: a flag still on its way stays queued."""
        while self.kept and not self.done:
            step, flag, captured, earlier = self.kept[0]
            ready, earlier_ready = flag.ready, None if earlier is None else earlier.ready
            # (_ready, inline: asked at every step on a device)
            if (ready is not None and not ready.query()) or (
                earlier_ready is not None and not earlier_ready.query()
            ):
                return None
            self.kept.popleft()
            bad = bool(flag.host)  # (read once: a host read per step on a device)
            if bad and captured is None:
                self._refuse(step, UNHELD if self.keep_late else BEHIND)
            elif bad and captured is not None:
                rec = new_record()
                return (step, rec) if self._run(hooks, rec, captured, step) else None
            elif earlier is not None and bool(earlier.host):
                self._refuse(step, EARLIER_FORWARD)
        if self.done:
            self.kept.clear()
        return None

    def wait_for_flags(self) -> bool:
        """Wait for the copies of every flag still on its way (only `Profiler.flush` may);
        True when there is one to look at."""
        pending = [f for _, flag, _, earlier in self.kept for f in (flag, earlier) if f is not None]
        pending += [f for f in (self.flag, self._earlier) if f is not None]
        for flag in pending:
            transfer.wait_ready(flag.ready)  # note: a CPU-GPU sync point, inside flush() only
        return bool(pending)

    def take_refused(self) -> list[tuple[int, str]]:
        """(step, why) of the non-finite steps found beyond a replay since the last call."""
        refused, self.refused = self.refused, []
        return refused

    def failed(self, step: int, exc: BaseException) -> None:
        """The replay of `step` raised (it is over either way: see `_run`)."""
        self.refused.append((step, f"the replay raised {type(exc).__name__}: {exc}"))

    def _refuse(self, step: int, why: str) -> None:
        """The first non-finite step found beyond a replay: none this run (every later one
        would run on weights that took its update), said once and sent to the publisher."""
        self.done = True
        self.clear()
        self.kept.clear()
        self.refused.append((step, why))
        if self._say is not None:
            self._say(
                "not replayed",
                f"the NaN/Inf of step {step} is not localised to a layer, and not replayed: {why}",
            )

    def _run(
        self, hooks: LayerHooks, rec: StepRecord, captured: CapturedForward, step: int
    ) -> bool:
        """Replay `captured` into `rec`: the one replay of the run, whether it finishes or
        raises; either way the model's buffers and the RNG are put back and nothing kept."""
        model = self._model_ref()
        if self.done or model is None:
            return False
        if (
            captured.changed_in_place()
        ):  # (its verdict would be a guess: "transient" for a reproducible NaN)
            self._refuse(step, INPUTS_CHANGED)
            return False
        self.done = True
        self.moved = self.updates - captured.updates  # 0: the very weights of that forward
        watch = (
            self._witness.watch(model, captured, step)
            if self._witness is not None
            else contextlib.nullcontext(None)
        )
        try:
            keep, drew = forward_again(model, hooks, rec, captured, watch)
            if drew:
                self.caveat = COMPILED_RNG
        except Exception as exc:
            self.failed(step, exc)
            raise
        finally:
            self.clear()  # done: no step's inputs are kept from here on
            self.kept.clear()
        if keep is not None:  # the capsule's copy, with the model's own buffers back
            keep(self.moved)
        return True


class ModuleState(NamedTuple):
    """What a forward may read and change besides its inputs and weights: the modules'
    buffers, the tensors and numbers they keep as plain attributes (a counter, a cache,
    spectral norm's power-iteration vectors), and Python's and NumPy's random generators.
    (State kept in lists or dicts is not in it.)"""

    buffers: list[tuple[nn.Module, str, torch.Tensor]]
    attributes: list[tuple[nn.Module, str, Any]]
    python_rng: Any
    numpy_rng: Any


def _module_state(model: nn.Module) -> ModuleState:
    """The model's state as it is now (the tensors themselves, not copies)."""
    buffers, attributes = [], []
    for m in model.modules():
        buffers += [(m, name, b) for name, b in m._buffers.items() if b is not None]
        attributes += [
            (m, name, v)
            for name, v in vars(m).items()
            if not name.startswith("__") and isinstance(v, (torch.Tensor, int, float))
        ]
    return ModuleState(buffers, attributes, random.getstate(), _numpy_rng())


def state_at_forward_start(model: nn.Module) -> ModuleState:
    """A copy of the model's state as a forward begins, for a replay to start from
    (`forward_again(start=...)`): a forward that updates what it reads (spectral norm's
    vectors, a counter) then replays as it ran."""
    now = _module_state(model)
    with torch.no_grad():
        return now._replace(
            buffers=[(m, name, b.clone()) for m, name, b in now.buffers],
            attributes=[
                (m, name, v.clone() if isinstance(v, torch.Tensor) else v)
                for m, name, v in now.attributes
            ],
        )


def _numpy_rng() -> Any:
    numpy = sys.modules.get("numpy")  # (only where the program uses it)
    return numpy.random.get_state() if numpy is not None else None


def _set_python_rngs(state: ModuleState) -> None:
    random.setstate(state.python_rng)
    numpy = sys.modules.get("numpy")
    if numpy is not None and state.numpy_rng is not None:
        numpy.random.set_state(state.numpy_rng)


def _clone_as_leaf(t: torch.Tensor) -> torch.Tensor:
    """A replayed input's copy (made under no_grad: a leaf of the replay's graph), needing a
    gradient where the step's input did."""
    copy = t.clone()
    return copy.requires_grad_() if t.requires_grad and copy.is_floating_point() else copy


def forward_again(
    model: nn.Module,
    hooks: LayerHooks,
    rec: StepRecord,
    captured: CapturedForward,
    watch: Any = None,
    start: ModuleState | None = None,
    output_into: list[Any] | None = None,
    backward: Callable[[Any], None] | None = None,
) -> tuple[Any, bool]:
    """Run `captured` once more, eagerly (a compiled model too), under no_grad, with the
    layer checks recording into `rec`, on the model's current weights, from the RNG state
    of its start and, given `start` (state_at_forward_start), from the modules' state and
    Python's generators as they were then; the model's buffers, its modules' plain tensor and
    number attributes and every generator are as they were afterwards, whatever happens.
    Returns (what `watch` yielded, whether the forward drew random numbers: asked of a
    compiled forward's only, whose RNG state hookprof took itself); the forward's output is
    appended to `output_into`, if given. With `backward`, the forward builds its graph (grad
    on) and `backward(output)` runs right after it, outside its autocast (as a loop's
    backward does) and still inside the replay (the layers' records, the buffers and RNG as
    the replay has them)."""
    target = captured.module if captured.module is not None else model
    outside = rng_state(cuda=captured.cuda_rng is not None)
    # the buffers, and state a module keeps outside them (a tensor or a number set as a plain
    # attribute: a counter, a cache), are put back: the re-run of sampled steps runs the
    # forward's Python again on every checked step of a compiled model
    now = _module_state(model)
    originals, attributes = now.buffers, now.attributes
    try:
        with torch.no_grad():
            if start is None:
                for module, name, buffer in originals:
                    module._buffers[name] = buffer.clone()  # the replay writes here, if anywhere
                for module, name, value in attributes:
                    if isinstance(value, torch.Tensor):
                        module.__dict__[name] = value.clone()
            else:  # the state the forward began from (copies again: `start` stays as it is)
                for module, name, buffer in start.buffers:
                    module._buffers[name] = buffer.clone()
                for module, name, value in start.attributes:
                    module.__dict__[name] = (
                        value.clone() if isinstance(value, torch.Tensor) else value
                    )
                _set_python_rngs(start)
            # the inputs too: a forward that edits its input in place (`x /= 2`) would edit the
            # step's tensors again, and autograd, which saved them, would raise in the user's
            # backward; the replay's edits go to its own copies (with `backward`, an input
            # that needed a gradient needs one again: the graph is the step's)
            args, kwargs = map_tensors(
                (captured.args, captured.kwargs or {}),
                torch.Tensor.clone if backward is None else _clone_as_leaf,
            )
        set_rng(RngState(captured.cpu_rng, captured.cuda_rng))
        with (
            hooks.replaying_into(rec),
            torch.no_grad() if backward is None else torch.enable_grad(),
            eager(),
        ):
            with (
                autocast_of(captured.modes),
                watch if watch is not None else contextlib.nullcontext(None) as kept,
            ):
                hooks.note_root_inputs(args, kwargs)
                output = target(*args, **kwargs)
                if output_into is not None:  # (the spike replay compares it: integrity/)
                    output_into.append(output)
            if backward is not None:
                backward(output)
        return kept, captured.compiled and _drew_random_numbers(captured)
    finally:
        for module, name, buffer in originals:  # the very same tensors, untouched
            module._buffers[name] = buffer
        for module, name, value in attributes:
            module.__dict__[name] = value
        set_rng(outside)
        _set_python_rngs(now)
