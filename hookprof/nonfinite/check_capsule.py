"""The capsule of a replay check's mismatch (issue 43 item 2's third answer), with capsule_dir.

A check step whose replay did not reproduce its forward (integrity/replay_check.py) says *the
machine*, from one device's two runs of the same forward. Which of the two was wrong, and
whether it happens elsewhere, is for another process: `hookprof replay CAPSULE` runs the
step's forward again from this capsule (check_reproduce.py) and compares each
layer's output bits with the step's own and with the in-place replay's.

The capsule is taken in the check step itself, after the replay and before the update: the
step's own weights, its forward's inputs and RNG (torch's, Python's), and the modules' state
as the forward began (BatchNorm's statistics, spectral norm's vectors, a module's counter:
`state_at_forward_start`), with every compared output's bit sum of both forwards, in call
order. To know whether there is a mismatch then, the comparison's flags are read on the host:
one wait for the device, on a check step (once per `sdc_check_interval_s`) and only with
capsule_dir set. The capsule shares the process's `capsule_max_count` with the NaN
capsules, and its size cap: above `capsule_max_bytes` none is written, and one line says so.
A fault here costs the capsule only.

The spike replay (integrity/spike_replay.py, Config.spike_replay) writes the same form when a
spike's step gave other output bits: the weights are the step's own (put back in the model
for its replay), and what is compared is every layer's output, then the model's (layer "":
`shown`). It writes one too for a spike it reproduced whose loss or gradient norm passed the
rule's own limit (`alike`): there the batch is the suspect, kept with the samples of largest
loss when the loop gave them (`check["suspects"]`).
"""

from __future__ import annotations

import io
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookprof._version import __version__
from hookprof.config import Config
from hookprof.device.identity import device_name
from hookprof.faults import Faults
from hookprof.files import write_atomic
from hookprof.nonfinite.capsule import (
    FORMAT,
    _give_back_slot,
    _saved,
    _take_slot,
    capsule_path,
    class_name,
    dtypes_of,
    module_entry,
    module_on_cpu,
    tensor_bytes,
    to_cpu,
)
from hookprof.snapshot import suspects_from

FORM_CHECK = "replay check"  # the capsule's form (reproduce.py hands it to check_reproduce.py)


def first_difference(order: Sequence[int], parts: Sequence[torch.Tensor]) -> int | None:
    """The first position (in call order) whose output differs, read from the comparison's
    device flags (`ReplayCheck.compare`: stacks in `order`); None when every one is alike.
    This is the one read that waits for the device."""
    if not parts:
        return None
    # note: a CPU-GPU sync point (capsule_dir set: a check step, or a spike's replay, only)
    flags = torch.cat([p.reshape(-1).to("cpu") for p in parts]).tolist()
    return min((k for k, flag in zip(order, flags) if flag), default=None)


class CheckCapsules:
    """Writes the capsule of a step whose replay differed (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        model: str,
        rank: int,
        faults: Faults,
        say: Callable[[str, str], None],
        what: str = "replay check",
    ):
        assert config.capsule_dir is not None
        self._what = what  # whose replay: "replay check", or "spike replay" (integrity/)
        self._dir = config.capsule_dir
        self._max_count = config.capsule_max_count
        self._max_bytes = config.capsule_max_bytes
        self._model, self._rank = model, rank
        self._faults, self._say = faults, say

    def keep(
        self,
        model: nn.Module,
        captured: Any,
        start: Any,
        names: Sequence[str],
        original: Sequence[torch.Tensor],
        replayed: Sequence[torch.Tensor],
        flags: tuple[Sequence[int], Sequence[torch.Tensor]],
        *,
        step: int,
        deterministic: bool,
        alike: bool = False,
        suspects: torch.Tensor | None = None,
    ) -> str | None:
        """Check step `step`'s comparison (`names`: the compared outputs' layers, in call
        order; `original` and `replayed`: their bit sums; `flags`: ReplayCheck.compare's
        order and device flags): when an output differs, or with `alike` when none does (a
        spike the replay reproduced: its batch is the suspect), its capsule written; returns
        its path, or None (no capsule due; or said, or counted as a fault). `suspects`: the
        batch's samples of largest loss (spike_replay.py `suspects_of`)."""
        with self._faults.contain(f"{self._what} capsule", disable=False):
            first = first_difference(*flags)
            if first is None and not alike:
                return None
            # (the device has computed these already: the flags just read depend on them)
            sums = torch.stack([t.to("cpu") for t in (*original, *replayed)]).tolist()
            check: dict[str, Any] = {
                "layers": list(names),
                "original": sums[: len(original)],
                "replayed": sums[len(original) :],
                "first": first,
            }
            # (what the sums are: `hookprof replay` recomputes them with the same function)
            check["checksum"] = "output_checksum"
            if suspects is not None:  # [(sample, its loss)], the largest first; the total
                found, total = suspects_from(suspects.to("cpu").tolist())
                check["suspects"], check["loss_total"] = [tuple(s) for s in found], total
            # the slot first: once the count is reached, no copy of the model is made at all
            # (a failing device can make every check step a mismatch); a reproduced spike's
            # never takes the last one, kept for a NaN's or a mismatch's
            if not slot_or_said(
                self._max_count, first is None, self._say, self._what, step, "spike"
            ):
                return None
            path = capsule_path(self._dir, self._model, self._rank, step)
            if not write_in_slot(
                path, lambda: self._contents(model, captured, start, check, step, deterministic)
            ):
                return None
            verdict = (
                f"did not reproduce its forward (first differing output: {shown(names[first])})"
                if first is not None
                else "reproduced its forward bit for bit (the data: its batch is in the capsule"
                + (
                    ", with its samples of largest loss: "
                    + ", ".join(f"sample {s} (loss {v:.4g})" for s, v in check["suspects"])
                    if check.get("suspects")
                    else ""
                )
                + ")"
            )
            self._say(
                f"{self._what} capsule {path}",
                f"the {self._what} of step {step} {verdict}; capsule written to {path} "
                f"(hookprof replay {path} runs it in another process, on another device or "
                "the CPU)",
            )
            return path
        return None

    def _contents(
        self,
        model: nn.Module,
        captured: Any,
        start: Any,
        check: dict[str, Any],
        step: int,
        deterministic: bool,
    ) -> dict[str, Any] | None:
        """The capsule (None above capsule_max_bytes, said); `check`: the compared outputs'
        layers and both forwards' bit sums, and the first position that differs."""
        inputs = (to_cpu(captured.args), to_cpu(captured.kwargs or {}))
        state = model.state_dict()
        sizes = {
            "state_dict_bytes": tensor_bytes(state),
            "input_bytes": tensor_bytes(inputs),
            "max_bytes": self._max_bytes,
        }
        if sizes["state_dict_bytes"] + sizes["input_bytes"] > self._max_bytes:
            self._say(
                "check capsule too large",
                f"no capsule written for the {self._what} of step {step}: the model's "
                f"state_dict ({sizes['state_dict_bytes']} bytes) and the step's inputs "
                f"({sizes['input_bytes']} bytes) are above capsule_max_bytes={self._max_bytes}",
            )
            return None
        devices = {t.device for t in state.values()}
        dropped: list[int] = []
        copied = _as_forward_began(model, start, dropped)
        cuda = captured.cuda_rng is not None
        view = {
            "form": FORM_CHECK,
            "kind": self._what,
            "step": step,
            "model": self._model,
            "model_class": class_name(type(model)),
            "rank": self._rank,
            **where_written(devices, cuda),
            "deterministic": deterministic,
            "backends": backends(),
            "modes": captured.modes,
            "first_layer": None if check["first"] is None else check["layers"][check["first"]],
            "dtypes": {"inputs": dtypes_of(inputs)},
            "sizes": sizes,
            "hooks_left_out": dropped[0],
            "event": {
                "replay": "reproduced" if check["first"] is None else "not_reproduced",
                "layer": None if check["first"] is None else check["layers"][check["first"]],
            },
        }
        entry = (
            next((n for n, m in model.named_modules() if m is captured.module), None)
            if captured.module is not None
            else None
        )
        return {
            "format": FORMAT,
            "view": view,
            "forward": {
                "inputs": _saved(inputs),
                "entry": entry,
                "cpu_rng": captured.cpu_rng,
                "cuda_rng": captured.cuda_rng,
                "python_rng": _saved(start.python_rng),
                "numpy_rng": _saved(start.numpy_rng) if start.numpy_rng is not None else None,
            },
            "model": module_entry(copied),
            "check": check,
        }


def slot_or_said(
    max_count: int,
    reproduced: bool,
    say: Callable[[str, str], None],
    what: str,
    step: int,
    kind: str,
) -> bool:
    """A slot of capsule_max_count taken for the capsule of `what` at step `step`; or, when
    the count is reached, False and `say` says so (once per `what`). A reproduced `kind`'s
    never takes the last slot, kept for a NaN's or a difference's."""
    if _take_slot(max_count - reproduced):
        return True
    say(
        f"{what} capsule limit",
        f"no capsule written for the {what} of step {step}: this process has written "
        f"capsule_max_count={max_count} already"
        + (f" (a reproduced {kind}'s leaves the last for a NaN's)" if reproduced else ""),
    )
    return False


def write_in_slot(path: str, contents: Callable[[], dict[str, Any] | None]) -> bool:
    """Write the capsule `contents()` builds to `path` in a slot of capsule_max_count taken
    already; the slot given back when it builds none (said by it) or the write fails."""
    try:
        built = contents()
        if built is None:
            _give_back_slot()
            return False
        buffer = io.BytesIO()
        torch.save(built, buffer)
        write_atomic(path, buffer.getvalue(), make_dirs=True)
    except BaseException:
        _give_back_slot()
        raise
    return True


def where_written(devices: set[torch.device], cuda: bool) -> dict[str, Any]:
    """A capsule view's account of where it was written: host, process, time, the devices
    of its tensors (a GPU's UUID where known), torch's and hookprof's versions."""
    device = device_name(devices)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "written_at": time.time(),
        "device": device,
        "device_type": next(iter(sorted({d.type for d in devices})), "cpu"),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "device_uuid": device if device.startswith("GPU-") else None,
        "torch_version": str(torch.__version__),
        "hookprof_version": __version__,
    }


def backends() -> dict[str, Any]:
    """The settings that choose kernels, and so the bits a forward gives (the replay in
    another process sets them as the step had them: check_reproduce.py)."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _as_forward_began(model: nn.Module, start: Any, dropped: list[int]) -> nn.Module:
    """A CPU copy of `model` with the step's weights (not updated yet) and the modules' state
    as its forward began (`start`: replay.ModuleState), which the forward has changed since."""
    copy = module_on_cpu(model, dropped)
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    for module, name, buffer in start.buffers:
        copy.get_submodule(names[id(module)])._buffers[name] = buffer.detach().to("cpu", copy=True)
    for module, name, value in start.attributes:
        copy.get_submodule(names[id(module)]).__dict__[name] = (
            value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        )
    return copy


def check_capsules(
    config: Config,
    model: str,
    rank: int,
    faults: Faults,
    say: Callable[[str, str], None],
    what: str = "replay check",
) -> CheckCapsules | None:
    """The capsules of a replay's differences (`what`: the replay check's, with
    sdc_check_interval_s; the spike replay's, with spike_replay), when capsule_dir is set."""
    armed = (
        config.sdc_check_interval_s is not None if what == "replay check" else config.spike_replay
    )
    if not armed or config.capsule_dir is None:
        return None
    return CheckCapsules(config, model=model, rank=rank, faults=faults, say=say, what=what)


def shown(name: str) -> str:
    """A compared output's layer in words (the spike replay compares the model's output)."""
    return name or "the model's output"
