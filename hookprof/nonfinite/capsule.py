"""The incident capsule: the bad step's computation saved to one file, to be re-run anywhere.

When `Config.capsule_dir` is set, the forward replay that names a NaN's producer (replay.py)
is watched: every module call of the replay is seen (its inputs, output and the RNG state at
its start, by reference: nothing is copied while the replay runs). When the replay is over,
still at the incident step, one read of the calls' finiteness flags (the one wait for the
device, and only at that step) picks the calls that made a NaN/Inf from finite inputs: the
candidate producers. Their modules, inputs and outputs are copied to the CPU then, with the
step's forward inputs and the model itself (under `capsule_max_bytes`; above it a hash of
each parameter). That copy (the `CapsuleDraft`) is written once the first NaN/Inf is settled
(`write`): the producer the attribution named, or the whole forward when none is, and
hookprof's view of the incident. `hookprof replay CAPSULE` (reproduce.py) re-runs it.

Nothing here runs without an incident: the hooks go in for the replay only, and the replay
runs only for a non-finite step. At most `capsule_max_count` capsules are written per
process (a process-wide count: several models, attach after attach).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hookprof._version import __version__
from hookprof.config import Config
from hookprof.device.identity import device_name
from hookprof.faults import Faults
from hookprof.files import safe_label, write_atomic
from hookprof.layers import INPUT_NAME, ROOT_NAME
from hookprof.nonfinite.replay import rng_state
from hookprof.snapshot import NonFiniteEvent
from hookprof.tensors import every_tensor, iter_tensors, map_tensors

FORMAT = 1  # the capsule's layout (reproduce.py refuses a newer one by name)
FORM_PRODUCER = "producer"  # the named producer module, its inputs and output
FORM_MODEL = "model"  # no layer named: the step's forward inputs and the whole model
FORM_HASHES = "inputs and hashes"  # ... the model above capsule_max_bytes: a hash per parameter
# a backward NaN: the step's forward inputs, the model before the update, and the gradient
# each output tensor received (the backward is re-run from them: no loss function needed)
FORM_BACKWARD = "backward"

_count_lock = threading.Lock()
_written = 0  # capsules written (or being written) by this process


def forget_written() -> None:
    """Start the per-process count again (hookprof._testing: tests in one process)."""
    global _written
    with _count_lock:
        _written = 0


def _take_slot(limit: int) -> bool:
    global _written
    with _count_lock:
        if _written >= limit:
            return False
        _written += 1
        return True


def _give_back_slot() -> None:
    global _written
    with _count_lock:
        _written -= 1


def capsule_path(directory: str, model: str, rank: int, step: int) -> str:
    """The capsule's file; a second one of this process for the same model, rank and step (a
    model attached again under the same name) is told apart by a count: never overwritten."""
    stem = os.path.join(
        directory, f"hookprof-capsule-{safe_label(model)}-rank{rank}-step{step}-{os.getpid()}"
    )
    path, n = stem + ".pt", 1
    while os.path.lexists(path):
        n += 1
        path = f"{stem}-{n}.pt"
    return path


# ---------------------------------------------------------------- copies to the CPU


def to_cpu(value: Any) -> Any:
    """`value` with every tensor in it (tuples, lists, dicts) copied to the CPU, detached."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=True))


def module_on_cpu(module: nn.Module, dropped: list[int] | None = None) -> nn.Module:
    """A copy of `module` on the CPU without its hooks, made without a second copy on its
    device: parameters and buffers go straight to the CPU (deepcopy's memo), the hook
    dictionaries (hookprof's or anyone's) come back empty; `dropped` gets how many of the
    loop's own hooks were left out (hookprof's are not counted)."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for key, value in vars(m).items():
            if _is_hooks(key, value):
                memo[id(value)] = type(value)()
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(
                    p.detach().to("cpu", copy=True), requires_grad=p.requires_grad
                )
        for b in m._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = b.detach().to("cpu", copy=True)
    copied = copy.deepcopy(module, memo)
    # hookprof's copies (step/copies.py) keep the user's hooks, as an EMA copy must: a
    # capsule keeps none (a hook of the loop's own, a local function, does not pickle)
    left_out = 0
    for m in copied.modules():
        for key, value in list(vars(m).items()):
            if _is_hooks(key, value):
                left_out += len(value) if key != "_forward_hooks_always_called" else 0
                m.__dict__[key] = type(value)()
    if dropped is not None:
        dropped.append(left_out)
    return copied


def _is_hooks(key: str, value: Any) -> bool:
    return key.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")) and isinstance(
        value, dict
    )


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def importable(cls: type) -> bool:
    """Can a fresh process import `cls` by its name (what unpickling the module needs)?"""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return False
    try:
        import importlib

        found: Any = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except Exception:
        return False
    return found is cls


def module_entry(module: nn.Module) -> dict[str, Any]:
    """A module as the capsule holds it: pickled whole (bytes, loaded on its own by
    `hookprof replay`) when its class is importable, else its state_dict and class name.
    `module` is a CPU copy already."""
    entry: dict[str, Any] = {"class": class_name(type(module)), "training": module.training}
    why = None
    if importable(type(module)):
        try:
            buffer = io.BytesIO()
            torch.save(module, buffer)
            entry["pickle"] = buffer.getvalue()
            return entry
        except Exception as exc:  # an attribute that does not pickle (a lambda, a lock)
            why = f"it does not pickle: {type(exc).__name__}: {exc}"
    entry["state_dict"] = {k: v.detach() for k, v in module.state_dict().items()}
    entry["not_pickled"] = why or f"its class {entry['class']} cannot be imported by name"
    return entry


def tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in every_tensor(value))


def parameter_hash(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (compare with the same of a checkpoint's)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def dtypes_of(value: Any) -> list[str]:
    return [str(t.dtype).removeprefix("torch.") for t in every_tensor(value)]


# ---------------------------------------------------------------- the replay, watched


@dataclasses.dataclass(slots=True)
class CallSeen:
    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    versions: list[int]  # of the input tensors at the call's start (an in-place change shows)
    inputs_finite: Any  # 0-d bool tensor (or True)
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    output: Any = None
    output_bad: Any = False


def _all_finite(value: Any) -> Any:
    """One 0-d bool on the device (no wait): is every floating tensor in `value` finite?"""
    flags = [
        torch.isfinite(t.detach()).all()
        for t in iter_tensors(value)
        if (t.is_floating_point() or t.is_complex()) and t.numel()
    ]
    if not flags:
        return True
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


@dataclasses.dataclass
class CapsuleDraft:
    """What the replay of step `step` saw, on the CPU, until the first NaN/Inf is settled."""

    step: int
    moved: int  # updates between the bad forward and its replay (0: the weights it had)
    modes: dict[str, Any] | None
    entry: str | None  # the module the loop called (None: the model itself)
    inputs: bytes  # torch.save of (args, kwargs) of the step's forward
    input_dtypes: list[str]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    producers: dict[str, dict[str, Any]]  # candidate name -> its capsule entry
    model: dict[str, Any] | None  # module_entry of the model, under the cap
    hashes: dict[str, str] | None  # above the cap: sha256 of each parameter
    left_out: list[str]
    model_class: str
    device: str
    parameter_dtypes: dict[str, str]
    sizes: dict[str, int]
    kind: str = "forward"  # "backward": drafted at the backward's end (Capsules.backward)
    output_grads: bytes | None = None  # kind "backward": torch.save of the outputs' gradients


class ReplayWatch:
    """The hooks of one replay: every module call's inputs, output, RNG at its start."""

    def __init__(self, model: nn.Module, cuda: bool):
        self._names = {id(m): (name or ROOT_NAME) for name, m in model.named_modules()}
        self._cuda = cuda
        self.calls: list[CallSeen] = []
        self._open: list[CallSeen] = []

    @contextmanager
    def watching(self, model: nn.Module) -> Iterator[None]:
        handles = []
        try:
            for module in model.modules():
                handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                handles.append(module.register_forward_hook(self._post, always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensors = list(iter_tensors((args, kwargs)))
        call = CallSeen(
            self._names.get(id(module), type(module).__name__),
            module,
            args,
            kwargs,
            [t._version for t in tensors],
            _all_finite((args, kwargs)),
            *rng_state(self._cuda),
        )
        self._open.append(call)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._open or self._open[-1].module is not module:
            return  # a call begun before the hooks went in
        call = self._open.pop()
        call.output = output
        flag = _all_finite(output)
        call.output_bad = False if flag is True else ~flag
        self.calls.append(call)  # in the order calls end: innermost first

    def producers(self) -> list[CallSeen]:
        """The calls that made a NaN/Inf from finite inputs, innermost first, one per name."""
        flags = []
        for c in self.calls:
            flags += [c.inputs_finite, c.output_bad]
        tensors = [f for f in flags if isinstance(f, torch.Tensor)]
        # note: a CPU-GPU sync point, at the incident step only (after its replay): one
        # stack on the flags' device, then one copy to the host (not one per flag)
        values = (
            iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist())
            if tensors
            else iter(())
        )
        read = [bool(next(values)) if isinstance(f, torch.Tensor) else bool(f) for f in flags]
        out: dict[str, CallSeen] = {}
        for k, c in enumerate(self.calls):
            if read[2 * k] and read[2 * k + 1] and c.name not in out:
                out[c.name] = c
        return list(out.values())


# ---------------------------------------------------------------- the part


class Capsules:
    """The capsule of one profiler: watches its replay (at most one per run), keeps the
    draft, writes it when asked (`write`). Faults here cost the capsule only."""

    def __init__(
        self,
        config: Config,
        *,
        faults: Faults,
        send: Callable[[int, str], None],
        say: Callable[[str, str], None] | None = None,
    ):
        self._dir = config.capsule_dir
        self._max_count = config.capsule_max_count
        self._max_bytes = config.capsule_max_bytes
        self._policy = config.on_nonfinite
        self._faults = faults
        self._send = send  # (step, path) to the publisher: the event and the counter carry it
        self._say = say
        self.draft: CapsuleDraft | None = None
        self._draft_failed = False  # a backward draft was tried and failed (`missing`)
        self._taking = threading.Lock()
        self.path: str | None = None  # the capsule written, once it is

    @contextmanager
    def watch(self, model: nn.Module, captured: Any, step: int) -> Iterator[Callable[[int], None]]:
        """Around one replay of `captured` (replay.CapturedForward): yields `done(moved)`,
        which the replay calls after its forward ran and the model's buffers are back. A
        fault here (setting up, or building the draft) is counted and costs the capsule."""
        watch = None
        with self._faults.contain("incident capsule", disable=False):
            if self.draft is None and self.path is None:
                watch = ReplayWatch(model, captured.cuda_rng is not None)
        if watch is None:
            yield lambda moved: None
            return

        def done(moved: int) -> None:
            with self._faults.contain("incident capsule", disable=False):
                self.draft = self._draft(model, watch, captured, step, moved)
            watch.calls.clear()  # nothing of the step is held past here but the draft

        with watch.watching(model):
            yield done

    def _draft(
        self, model: nn.Module, watch: ReplayWatch, captured: Any, step: int, moved: int
    ) -> CapsuleDraft:
        producers = {}
        for call in watch.producers():
            now = [t._version for t in iter_tensors((call.args, call.kwargs))]
            entry = module_entry(module_on_cpu(call.module))
            entry.update(
                name=call.name,
                module_type=type(call.module).__name__,
                inputs=_saved((to_cpu(call.args), to_cpu(call.kwargs))),
                output=_saved(to_cpu(call.output)),
                cpu_rng=call.cpu_rng,
                cuda_rng=call.cuda_rng,
                input_dtypes=dtypes_of((call.args, call.kwargs)),
                output_dtypes=dtypes_of(call.output),
                inputs_changed_in_place=now != call.versions,
            )
            producers[call.name] = entry
        return self._step_draft(model, captured, step, moved, producers)

    def _step_draft(
        self,
        model: nn.Module,
        captured: Any,
        step: int,
        moved: int,
        producers: dict[str, dict[str, Any]],
    ) -> CapsuleDraft:
        """The step's forward inputs and RNG (replay.CapturedForward), copied to the CPU, and
        the whole model (under capsule_max_bytes; above it a hash of each parameter) when no
        producer is kept."""
        left_out: list[str] = []
        inputs = (to_cpu(captured.args), to_cpu(captured.kwargs or {}))
        state = model.state_dict()
        state_bytes = tensor_bytes(state)
        input_bytes = tensor_bytes(inputs)
        sizes = {
            "state_dict_bytes": state_bytes,
            "input_bytes": input_bytes,
            "max_bytes": self._max_bytes,
        }
        model_entry, hashes = None, None
        # a capsule of a named producer holds the producer (FORM_PRODUCER): the whole model
        # is copied or hashed only when there is none (it cost 1.7 s of a 96 MiB model's 2.8 s)
        if not producers and state_bytes + input_bytes <= self._max_bytes:
            model_entry = module_entry(module_on_cpu(model))
        elif not producers:
            hashes = {name: parameter_hash(t) for name, t in state.items()}
            left_out.append(
                f"the model's state_dict ({state_bytes} bytes, with {input_bytes} bytes of inputs "
                f"above capsule_max_bytes={self._max_bytes}): a sha256 of each tensor instead"
            )
        devices = {t.device for t in state.values()}
        return CapsuleDraft(
            step=step,
            moved=moved,
            modes=getattr(captured, "modes", None),
            entry=next((n for n, m in model.named_modules() if m is captured.module), None)
            if captured.module is not None
            else None,
            inputs=_saved(inputs),
            input_dtypes=dtypes_of(inputs),
            cpu_rng=captured.cpu_rng,
            cuda_rng=captured.cuda_rng,
            producers=producers,
            model=model_entry,
            hashes=hashes,
            left_out=left_out,
            model_class=class_name(type(model)),
            device=device_name(devices),
            parameter_dtypes={k: str(v.dtype).removeprefix("torch.") for k, v in state.items()},
            sizes=sizes,
        )

    def backward(
        self, model: nn.Module, captured: Any, output_grads: list[torch.Tensor | None], step: int
    ) -> None:
        """A backward of step `step` left a non-finite gradient, seen at its end, before the
        update: draft its capsule now (the forward's inputs and RNG, the model as that
        forward ran it, the gradients its outputs received), unless one is drafted or
        written already. A fault costs the capsule only."""
        if self.draft is not None or self.path is not None:
            return
        self._draft_failed = True  # (until the draft below is made: `missing` says why)
        with self._faults.contain("incident capsule", disable=False):
            draft = self._step_draft(model, captured, step, 0, producers={})
            grads = _saved(to_cpu(output_grads))
            if captured.changed_in_place():
                draft.left_out.append(
                    "the step's inputs as the forward began: they were changed in place "
                    "since (the capsule holds them as they are now)"
                )
            self.draft = dataclasses.replace(
                draft,
                kind="backward",
                output_grads=grads,
                sizes={**draft.sizes, "output_grad_bytes": len(grads)},
            )
            self._draft_failed = False

    def missing(self, event: NonFiniteEvent) -> None:
        """The first NaN/Inf is settled and nothing was drafted for it: said once, why."""
        if self.draft is not None or self.path is not None or self._say is None:
            return
        if event.phase == "backward" and self._draft_failed:
            why = (
                "drafting it failed (counted in hookprof_internal_errors_total, part nonfinite; "
                "the log line before says what)"
            )
        elif event.phase == "backward":
            why = _WHY_NO_BACKWARD_CAPSULE
        elif event.phase == "loss":
            why = "a NaN/Inf of the loss alone gets none (the loss is computed outside the model)"
        elif event.replay == "not replayed":
            why = f"its step was not replayed ({event.replay_note or 'no reason given'})"
        else:
            return  # (a draft that failed is counted as a fault; the capsule limit said so)
        self._say(
            "no capsule",
            f"no capsule written for the NaN/Inf of step {event.step} ({event.phase}): {why}",
        )

    def write(
        self, event: NonFiniteEvent, *, model: str, rank: int, summary: str = ""
    ) -> str | None:
        """Write the draft for `event` (the first NaN/Inf, settled or about to be acted on);
        returns the capsule's path, None when there is none to write or it failed (counted
        in hookprof_internal_errors_total, said once: training goes on)."""
        with self._taking:  # flush() on another thread and a step end: one writes it
            draft, self.draft = self.draft, None
        if draft is None:
            return None
        if draft.step != event.step:
            # a capsule holds the incident's own step or nothing: a later step's forward (the
            # NaN weights a backward NaN's update left) would replay the consequence
            if self._say is not None:
                self._say(
                    "capsule of another step",
                    (
                        f"no capsule written for the NaN/Inf of step {event.step} ({event.phase}): the step "
                        f"kept was {draft.step}, not the incident's"
                        + (f". {_WHY_NO_BACKWARD_CAPSULE}" if event.phase == "backward" else "")
                    ),
                )
            return None
        if not _take_slot(self._max_count):
            if self._say is not None:
                self._say(
                    "capsule limit",
                    f"no capsule written for the NaN/Inf of step {draft.step}: this "
                    f"process has written capsule_max_count={self._max_count} already",
                )
            return None
        path = capsule_path(self._dir, model, rank, draft.step)  # type: ignore[arg-type]  # drafted: a dir
        try:
            buffer = io.BytesIO()
            torch.save(self._contents(draft, event, path, model, rank, summary), buffer)
            write_atomic(path, buffer.getvalue(), make_dirs=True)
        except Exception as exc:  # a full disk, capsule_dir not a directory: the capsule only
            _give_back_slot()
            self._faults.report(f"incident capsule ({path})", exc, disable=False)
            return None
        except BaseException as exc:  # Ctrl-C (a notebook loop that goes on): tried again
            _give_back_slot()
            with self._taking:
                if self.draft is None:
                    self.draft = draft  # the next step end (or flush, detach) writes it
            if self._say is not None:
                self._say(
                    "capsule interrupted",
                    f"the capsule of the NaN/Inf of step {draft.step} was "
                    f"interrupted ({type(exc).__name__}) before it was written: "
                    "it is written at the next step end, flush() or detach()",
                )
            raise
        self.path = path
        self._send(draft.step, path)
        return path

    def _contents(
        self,
        draft: CapsuleDraft,
        event: NonFiniteEvent,
        path: str,
        model: str,
        rank: int,
        summary: str,
    ) -> dict[str, Any]:
        named = event.layer if event.layer in draft.producers else None
        left_out = list(draft.left_out)
        if draft.kind == "backward":
            form = FORM_BACKWARD if draft.model is not None else FORM_HASHES
        elif named is not None:
            form = FORM_PRODUCER
            left_out.append(
                "the model's other modules and the step's forward inputs (the producer was named)"
            )
        else:
            form = FORM_MODEL if draft.model is not None else FORM_HASHES
            if event.layer == INPUT_NAME:
                left_out.append("no producer: the batch already held the NaN/Inf")
        cuda = draft.cuda_rng is not None
        view = {
            # plain types only: a capsule loads with torch.load(weights_only=True), which
            # refuses hookprof's own classes (FoundBy, ReplayOutcome: str() is their word)
            "event": {**_plain(dataclasses.asdict(event)), "capsule": path},
            "summary": summary,
            "step": draft.step,
            "model": model,
            "model_class": draft.model_class,
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "written_at": time.time(),
            "device": draft.device,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "device_uuid": draft.device if draft.device.startswith("GPU-") else None,
            "torch_version": str(torch.__version__),
            "hookprof_version": __version__,
            "policy": self._policy,
            "weights_intact": draft.moved == 0,
            "updates_since_forward": draft.moved,
            "modes": draft.modes,
            "dtypes": {"inputs": draft.input_dtypes, "parameters": draft.parameter_dtypes},
            "form": form,
            "left_out": left_out,
            "sizes": draft.sizes,
        }
        contents: dict[str, Any] = {"format": FORMAT, "view": view}
        if named is not None:
            contents["producer"] = draft.producers[named]
            return contents
        contents["forward"] = {
            "inputs": draft.inputs,
            "entry": draft.entry,
            "cpu_rng": draft.cpu_rng,
            "cuda_rng": draft.cuda_rng,
        }
        if draft.output_grads is not None:
            contents["backward"] = {"output_grads": draft.output_grads}
        if draft.model is not None:
            contents["model"] = draft.model
        elif draft.hashes is not None:
            contents["hashes"] = draft.hashes
        else:  # the replay found producers, and the event names none of them (rare)
            left_out.append("the model (the replay found a producer other than the one named)")
        return contents


# why a backward NaN may have no capsule of its own step (said with the note above)
_WHY_NO_BACKWARD_CAPSULE = (
    "A backward NaN's capsule is drafted at that backward's end, before the update, which "
    "needs its gradient check on the host there: on a CPU always, on a GPU with "
    "nonfinite_sync=True (one more wait per step)"
)


def _saved(value: Any) -> bytes:
    """torch.save of `value` as bytes: the capsule itself loads without the user's classes,
    and each part that needs them is loaded on its own (reproduce.py names what is missing)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def describe_capsule(path: str | None) -> str:
    return f"; capsule written to {path} (hookprof replay {path})" if path else ""


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every str subclass (an enum's member) as a plain str."""
    return {k: str(v) if isinstance(v, str) else v for k, v in values.items()}
