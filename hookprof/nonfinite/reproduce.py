"""`hookprof replay CAPSULE`: re-run an incident capsule (capsule.py) in a fresh process.

The producer module (or the whole model, when no layer was named) is loaded on `device` with
the saved inputs, weights, RNG state, grad mode and autocast, and run up to `runs` times
(the RNG put back before each). One verdict line, then the ranges of its inputs and output:

    reproduced: NaN/Inf made by fc1 (aten.addmm in Linear)
    not reproduced in 3 runs on cpu: transient (suspect nondeterminism or hardware)

Exit status: 0 reproduced, 1 not reproduced, 2 could not load (one line naming what is
missing: the file, the module's class, the weights left out above capsule_max_bytes).
Other forms are run by what the caller hands in (`forms`): the CLI hands a replay check's
capsule (check_capsule.py) to check_reproduce.py, which adds 3: no verdict (bits that cannot be
compared here).
The module is unpickled like any pickle: its class must be importable, and only a capsule
you trust should be loaded.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hookprof.layers import INPUT_NAME, ROOT_NAME
from hookprof.tensors import iter_tensors, map_tensors

REPRODUCED, NOT_REPRODUCED, NOT_LOADED = 0, 1, 2


class CannotLoad(Exception):
    """The capsule, or a part the replay needs, cannot be loaded (exit status 2)."""


def _bad(value: Any) -> bool:
    return any(
        not bool(torch.isfinite(t.detach()).all())
        for t in iter_tensors(value)
        if (t.is_floating_point() or t.is_complex()) and t.numel()
    )


def _to(value: Any, device: str) -> Any:
    return map_tensors(value, lambda t: t.to(device))


class FirstNonFiniteOp(TorchDispatchMode):
    """The first ATen op that made a NaN/Inf from finite inputs (e.g. "aten.addmm")."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.op is None and _bad(out) and not _bad((args, kwargs)):
            self.op = str(func.overloadpacket)
        return out


class ProducerFinder:
    """Hooks on every module of a model: the innermost call (the first to end) with finite
    inputs and a non-finite output; "(input)" when the model's inputs held one already."""

    def __init__(self, model: nn.Module):
        self._names = {id(m): (n or ROOT_NAME) for n, m in model.named_modules()}
        self._inputs_bad: list[bool] = []
        self.found: tuple[str, str] | None = None
        self._handles = []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._inputs_bad.append(_bad((args, kwargs)))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        inputs_bad = self._inputs_bad.pop() if self._inputs_bad else False
        if self.found is None and not inputs_bad and _bad(output):
            self.found = (self._names.get(id(module), type(module).__name__), type(module).__name__)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def load_module(entry: dict[str, Any]) -> nn.Module:
    """The module a capsule holds: unpickled whole, or built from its class (importable now,
    constructed without arguments) and its state_dict."""
    if "pickle" in entry:
        try:
            return torch.load(io.BytesIO(entry["pickle"]), map_location="cpu", weights_only=False)
        except (ImportError, AttributeError) as exc:
            raise CannotLoad(
                f"the module class {entry['class']} cannot be imported here ({exc}); {_WHERE_CODE}"
            ) from None
    why = entry.get("not_pickled", "")
    module_name, _, qualname = entry["class"].rpartition(".")
    try:
        import importlib

        cls: Any = importlib.import_module(module_name.rsplit("<locals>", 1)[0].rstrip("."))
        for part in qualname.split("."):
            cls = getattr(cls, part)
        module = cls()
        module.load_state_dict(entry["state_dict"])
    except Exception as exc:
        raise CannotLoad(
            f"the capsule holds only the state_dict of {entry['class']} ({why}), and that "
            f"class cannot be built here ({type(exc).__name__}: {exc}); {_WHERE_CODE}"
        ) from None
    return module


# what a "cannot be imported" message says to do
_WHERE_CODE = (
    "run `hookprof replay` where the model's code can be imported (its folder is on the path "
    "when you run from it, or set PYTHONPATH), with the class defined in a module, not in the "
    "training script run as __main__"
)


def _autocast(modes: dict[str, Any] | None, device: str) -> Any:
    """The training forward's autocast, on the replay's device (a CUDA capsule's dtype on the
    CPU too)."""
    autocast = (modes or {}).get("autocast") or {}
    dtype = autocast.get(device) or next(iter(autocast.values()), None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=getattr(torch, dtype))


def _set_rng(
    cpu_rng: torch.Tensor | None, cuda_rng: list[torch.Tensor] | None, device: str
) -> None:
    if cpu_rng is not None:
        torch.set_rng_state(cpu_rng)
    if cuda_rng is not None and device == "cuda":
        torch.cuda.set_rng_state_all(cuda_rng[: torch.cuda.device_count()])


def describe_range(label: str, value: Any) -> list[str]:
    """One line per tensor: shape, dtype, finite range, NaN and Inf counts."""
    lines = []
    tensors = list(iter_tensors(value))
    for k, t in enumerate(tensors):
        name = label if len(tensors) == 1 else f"{label}[{k}]"
        shape = "x".join(str(s) for s in t.shape) or "scalar"
        if not (t.is_floating_point() or t.is_complex()) or not t.numel():
            lines.append(f"  {name}: {str(t.dtype).removeprefix('torch.')} {shape}")
            continue
        x = t.detach().to("cpu", torch.float64)
        finite = x[torch.isfinite(x)]
        span = (
            f"[{finite.min().item():.4g}, {finite.max().item():.4g}]"
            if finite.numel()
            else "[no finite value]"
        )
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        lines.append(
            f"  {name}: {str(t.dtype).removeprefix('torch.')} {shape}, finite range {span}, "
            f"{nan} NaN, {inf} Inf"
        )
    return lines


def _say_ranges(say: Callable[[str], None], args: Any, kwargs: Any, output: Any) -> None:
    say("inputs:")
    for line in describe_range("args", args) + describe_range("kwargs", kwargs):
        say(line)
    say("output:")
    for line in describe_range("output", output):
        say(line)


def load(path: str) -> dict[str, Any]:
    try:
        capsule = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CannotLoad(f"no capsule at {path}") from None
    except Exception as exc:
        raise CannotLoad(
            f"{path} is not a hookprof capsule ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(capsule, dict) or "view" not in capsule:
        raise CannotLoad(f"{path} is not a hookprof capsule")
    if capsule.get("format", 0) > 1:
        raise CannotLoad(
            f"{path} is a newer capsule (format {capsule['format']}) than this hookprof reads"
        )
    return capsule


def _loaded(data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except (ImportError, AttributeError) as exc:
        raise CannotLoad(
            f"the step's inputs need a class that cannot be imported here ({exc})"
        ) from None


def _target(
    capsule: dict[str, Any],
) -> tuple[nn.Module, Any, Any, torch.Tensor | None, Any, str | None]:
    """(module to run, args, kwargs, cpu rng, cuda rng, the producer's name or None)."""
    producer = capsule.get("producer")
    if producer is not None:
        args, kwargs = _loaded(producer["inputs"])
        return (
            load_module(producer),
            args,
            kwargs,
            producer.get("cpu_rng"),
            producer.get("cuda_rng"),
            producer["name"],
        )
    forward = capsule["forward"]
    if "model" not in capsule:
        sizes = capsule["view"].get("sizes", {})
        if (
            "hashes" not in capsule
        ):  # not left out for its size: say what the capsule says (issue 38)
            raise CannotLoad(
                "the capsule holds no weights, and not for their size: its replay named a "
                "producer other than the layer of the incident it was written for, so it kept "
                "neither that producer nor the model (left out: "
                + "; ".join(capsule["view"].get("left_out", []))
                + ")"
            )
        raise CannotLoad(
            f"the capsule holds no weights: the model's state_dict ({sizes.get('state_dict_bytes')} "
            f"bytes) was above capsule_max_bytes ({sizes.get('max_bytes')}); it holds the step's "
            "inputs and a sha256 of each parameter (load them with torch.load, weights from your "
            "checkpoint)"
        )
    model = load_module(capsule["model"])
    args, kwargs = _loaded(forward["inputs"])
    target = model.get_submodule(forward["entry"]) if forward.get("entry") else model
    return target, args, kwargs, forward.get("cpu_rng"), forward.get("cuda_rng"), None


class FirstBadGradient:
    """A hook on every parameter of a model: the first whose gradient, as backward computes
    it (before it is accumulated), holds a NaN or Inf; its layer is the module holding it."""

    def __init__(self, model: nn.Module):
        self.found: str | None = None
        self._handles = [
            p.register_hook(self._hook(name))
            for name, p in model.named_parameters()
            if p.requires_grad
        ]

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.found is None and _bad(grad):
                self.found = name

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _replay_backward(
    capsule: dict[str, Any],
    target: tuple,
    grads: list[torch.Tensor | None],
    device: str,
    runs: int,
    say: Callable[[str], None],
) -> int:
    """A backward NaN's capsule: the forward again, then the backward from the gradients the
    outputs received in training (`grads`), up to `runs` times; the first non-finite
    gradient named. `target`: _target's, on `device`."""
    module, args, kwargs, cpu_rng, cuda_rng, _ = target
    view = capsule["view"]
    modes = view.get("modes") or {}
    found, output = None, None
    for _ in range(runs):
        _set_rng(cpu_rng, cuda_rng, device)
        module.zero_grad(set_to_none=True)
        finder = FirstBadGradient(module)
        try:
            with torch.enable_grad(), _autocast(modes, device):
                output = module(*args, **kwargs)
            pairs = [
                (t, g)
                for t, g in zip(iter_tensors(output), grads)
                if g is not None and t.requires_grad
            ]
            if not pairs:  # nothing to run the backward from: no verdict, rather than "transient"
                say(
                    "could not load: the capsule holds no gradient of the model's outputs that "
                    "matches this forward's outputs, so its backward cannot be run again"
                )
                return NOT_LOADED
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        finally:
            finder.remove()
        if finder.found is not None:
            found = finder.found
            break
    if found is not None:
        layer = found.rpartition(".")[0] or ROOT_NAME
        say(
            f"reproduced: NaN/Inf in the backward, first in the gradient of {found} (layer {layer})"
        )
        status = REPRODUCED
    else:
        say(
            f"not reproduced in {runs} runs on {device}: the backward's gradients were finite "
            "(transient: suspect nondeterminism or hardware)"
        )
        status = NOT_REPRODUCED
    say(
        f"capsule of step {view['step']} on rank {view['rank']} ({view['host']}, {view['device']}); "
        f"hookprof said: backward, layer {view['event'].get('layer')}"
    )
    _say_ranges(say, args, kwargs, output)
    return status


def replay(
    path: str,
    device: str = "cpu",
    runs: int = 3,
    say: Callable[[str], None] = print,
    forms: Mapping[str, Callable[..., int]] | None = None,
) -> int:
    """Run the capsule at `path`; say the verdict and the ranges; return the exit status.
    `forms`: the runners of other capsule forms, by the form its view names (each called
    with the loaded capsule, device, runs and say)."""
    try:
        capsule = load(path)
        if device == "cuda" and not torch.cuda.is_available():
            raise CannotLoad("--device cuda: CUDA is not available here")
        run_form = (forms or {}).get(capsule["view"].get("form"))
        if run_form is not None:  # (a replay check's capsule: check_reproduce.py)
            return run_form(capsule, device, runs, say)
        module, args, kwargs, cpu_rng, cuda_rng, producer = _target(capsule)
        module, args, kwargs = module.to(device), _to(args, device), _to(kwargs or {}, device)
        grads = (
            _to(_loaded(capsule["backward"]["output_grads"]), device)
            if "backward" in capsule and "model" in capsule
            else None
        )
    except CannotLoad as exc:
        say(f"could not load: {exc}")
        return NOT_LOADED
    if grads is not None:
        return _replay_backward(
            capsule, (module, args, kwargs, cpu_rng, cuda_rng, producer), grads, device, runs, say
        )
    view = capsule["view"]
    modes = view.get("modes") or {}
    output, found, op = None, None, None
    for _ in range(runs):
        _set_rng(cpu_rng, cuda_rng, device)
        finder = ProducerFinder(module)
        ops = FirstNonFiniteOp()
        try:
            with (
                torch.set_grad_enabled(bool(modes.get("grad_enabled", False))),
                _autocast(modes, device),
                ops,
            ):
                output = module(*args, **kwargs)
        finally:
            finder.remove()
        if _bad(output):
            found, op = finder.found, ops.op
            break
    if found is not None or _bad(output):
        name, module_type = found or (
            INPUT_NAME if _bad((args, kwargs)) else "(unknown)",
            type(module).__name__,
        )
        if producer is not None and name not in (INPUT_NAME, "(unknown)"):
            # names inside the capsule's module are relative to the producer
            name = producer if name == ROOT_NAME else f"{producer}.{name}"
        how = f"{op} in {module_type}" if op else module_type
        say(f"reproduced: NaN/Inf made by {name} ({how})")
        status = REPRODUCED
    else:
        say(
            f"not reproduced in {runs} runs on {device}: transient (suspect nondeterminism or hardware)"
        )
        status = NOT_REPRODUCED
    say(
        f"capsule of step {view['step']} on rank {view['rank']} ({view['host']}, {view['device']}); "
        f"hookprof said: {view['event'].get('replay') or 'no replay verdict'}, "
        f"layer {view['event'].get('layer')}"
    )
    if (capsule.get("producer") or {}).get("inputs_changed_in_place"):
        say(
            "note: the producer's inputs were changed in place after its call (the capsule holds "
            "them as they were when the replay ended): a verdict of (input) or transient may come "
            "from that"
        )
    _say_ranges(say, args, kwargs, output)
    return status
