"""`hookprof replay` of an update's capsule (update_capsule.py): the third answer for an update.

On a step that measured updates, one device ran the turn's update twice (the step's own, then
integrity/update_replay.py's second run, from copies). This runs it a third time, in this
process, from the capsule: the parameters' values before the update, their gradients, their
optimizer state and their groups' hyperparameters, given to a fresh optimizer of the step's
class, stepped `runs` times, each from the capsule again; each parameter's bits summed as the
step summed them (tensors.bits_sum). Then:

- the runs here differ from one another: no verdict (exit 3), nondeterministic kernels;
- another kind of device than the step's (a CUDA capsule on the CPU): other kernels, whose
  bits are not expected to match: no verdict (exit 3), the first parameter that differs said;
- the step's update and its second run agreed (a jump's capsule): every run here the step's
  bits, **reproduced** (exit 0: given these gradients, this state and these hyperparameters,
  the optimizer makes this update anywhere: the gradients, that is the data, or the
  hyperparameters are the suspect; the jumped layers' figures follow); otherwise **not
  reproduced here** (exit 1);
- they differed: every run here the step's bits: **reproduced elsewhere** (exit 0: the
  second run was the odd one); the second run's bits: **not reproduced** (exit 1: the step's
  update computed wrongly, at the first parameter named: the machine at that step); neither
  (exit 1): nondeterminism is the suspect.

The optimizer's class must be importable here (torch.optim's are); the capsule's parts are
unpickled like any pickle: only load a capsule you trust.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from hookprof.nonfinite.check_reproduce import NO_VERDICT, _backends
from hookprof.nonfinite.reproduce import NOT_REPRODUCED, REPRODUCED, CannotLoad, _loaded
from hookprof.tensors import bits_sum


def _optimizer_class(name: str) -> type:
    module_name, _, qualname = name.rpartition(".")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception as exc:
        raise CannotLoad(
            f"the optimizer class {name} cannot be imported here ({type(exc).__name__}: {exc})"
        ) from None
    return found


def _run(update: dict[str, Any], device: str) -> tuple[list[int], list[torch.Tensor]]:
    """One run of the update from the capsule: each parameter's bit sum after it, and the
    parameters."""
    params: list[torch.Tensor] = []
    for entry in update["params"]:
        p = torch.nn.Parameter(entry["value"].to(device, copy=True))
        if entry["grad"] is not None:
            p.grad = entry["grad"].to(device, copy=True)
        params.append(p)
    for spec in update["optimizers"]:
        cls = _optimizer_class(spec["class"])
        groups = [
            {
                **group["hyper"],
                **{key: group["hyper"][key].to(device) for key in group.get("on_device", ())},
                "params": [params[k] for k in group["params"]],
            }
            for group in spec["groups"]
        ]
        try:
            optimizer = cls(groups)
            for group in spec["groups"]:
                for k in group["params"]:
                    entry = update["params"][k]
                    optimizer.state[params[k]] = {
                        key: (
                            value.to(device, copy=True)
                            if key in entry["on_device"]
                            else value.clone()
                            if isinstance(value, torch.Tensor)
                            else value
                        )
                        for key, value in entry["state"].items()
                    }
            for key, value in spec["attributes"].items():
                setattr(optimizer, key, value.to(device, copy=True))
            optimizer.step()
        except Exception as exc:
            raise CannotLoad(
                f"{spec['class']}'s update cannot run on {device} here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
    return [int(bits_sum(p.detach())) for p in params], params


def _first(expected: list[int], got: list[int]) -> int | None:
    return next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)


def replay_update_capsule(
    capsule: dict[str, Any], device: str, runs: int, say: Callable[[str], None]
) -> int:
    """The capsule of a measured update, run here (see the module's docstring)."""
    view = capsule["view"]
    update = _loaded(capsule["update"])
    entries = update["params"]
    names = [e["name"] for e in entries]
    after, again = [e["after"] for e in entries], [e["again"] for e in entries]
    with _backends(view.get("backends") or {}):
        done = [_run(update, device) for _ in range(runs)]
    here, params = done[0]
    by_step, by_again = _first(after, here), _first(again, here)
    step_first = update["first"]

    def name(k: int | None) -> str:
        return "none" if k is None else names[k]

    at = f"{view['host']}, {view['device']}"
    if any(sums != here for sums, _ in done[1:]):
        say(
            f"no verdict: {runs} runs of the update on {device} gave different bits from one "
            "another (nondeterministic kernels here), so none can stand for the step's"
        )
        status = NO_VERDICT
    elif view.get("device_type", "cpu") != device:
        say(
            f"no verdict: the update ran on {view.get('device_type')}, this one on {device}: "
            "other kernels, whose bits are not expected to match (first parameter that differs "
            f"from the step's update here: {name(by_step)}); replay it on a "
            f"{view.get('device_type')} device for a verdict"
        )
        status = NO_VERDICT
    elif step_first is None:  # (the step's update and its second run agreed)
        if by_step is None:
            say(
                f"reproduced: {runs} runs on {device} make the step's own update bit for bit: "
                "given these gradients, this optimizer state and these hyperparameters, the "
                "optimizer makes this update anywhere (the gradients, that is the data, or the "
                "hyperparameters are the suspect, not the machine)"
            )
            status = REPRODUCED
        else:
            say(
                f"not reproduced here: {runs} runs on {device} differ first at "
                f"{name(by_step)}, where the step and its second run agreed (suspect this "
                "machine, or a kernel that differs between these two setups)"
            )
            status = NOT_REPRODUCED
    elif by_step is None:
        say(
            f"reproduced elsewhere: {runs} runs on {device} make the step's own update bit for "
            f"bit; the second run, which differed first at {name(step_first)}, was the odd one "
            "(suspect the machine during the second run)"
        )
        status = REPRODUCED
    elif by_again is None:
        say(
            f"not reproduced: {runs} runs on {device} agree with the second run and differ "
            f"from the step's own update first at {name(by_step)}: the step's update of "
            f"{name(by_step)} was computed wrongly on {at} (the machine, not the data)"
        )
        status = NOT_REPRODUCED
    else:
        say(
            f"not reproduced: {runs} runs on {device} differ from the step's own update first "
            f"at {name(by_step)} and from its second run's first at {name(by_again)} (suspect "
            "nondeterminism)"
        )
        status = NOT_REPRODUCED
    said = (
        f"not_reproduced, parameter {name(step_first)}"
        if step_first is not None
        else "differed from its second run before any reproduced in the run (not blamed)"
        if view["event"].get("replay") == "not_calibrated"
        else "reproduced"
    )
    say(
        f"capsule of the update of step {view['step']} on rank {view['rank']} ({at}), by "
        f"{', '.join(view.get('optimizers', []))}; hookprof said: {said}"
        + ("" if view.get("deterministic") else " (deterministic algorithms were off)")
    )
    for line in _figures(view, update, params):
        say(line)
    return status


def _figures(view: dict[str, Any], update: dict[str, Any], params: list[torch.Tensor]) -> list[str]:
    """The update's figures here, the jumped layers' parameters first: what made the update
    (its gradient's norm, its group's learning rate) beside what it did (update / weight)."""
    jumped = view.get("jumped") or []
    lines = [
        f"layer {j['layer'] or '(root)'}: update ratio {j['ratio']:.4g} at the step, above the "
        f"rule's limit {j['limit']:.4g}"
        for j in jumped
    ]
    lr_of: dict[int, Any] = {}
    for spec in update["optimizers"]:
        for group in spec["groups"]:
            for k in group["params"]:
                lr_of[k] = group["hyper"].get("lr")

    def in_jumped(name: str) -> bool:
        return any(name.startswith(f"{j['layer']}.") or not j["layer"] for j in jumped)

    rows = []
    for k, (entry, p) in enumerate(zip(update["params"], params)):
        before = entry["value"].double()
        after = p.detach().to("cpu").double()
        weight = float(after.norm())
        ratio = float((after - before).norm()) / weight if weight > 0 else math.nan
        grad = entry["grad"]
        rows.append(
            (
                not in_jumped(entry["name"]),
                -ratio if math.isfinite(ratio) else 0.0,
                f"{entry['name']}: update/weight {ratio:.4g}, gradient norm "
                + (f"{float(grad.double().norm()):.4g}" if grad is not None else "none")
                + f", weight norm {weight:.4g}, lr {_shown(lr_of.get(k))}",
            )
        )
    rows.sort(key=lambda row: row[:2])
    return lines + [row[2] for row in rows[:8]]


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return f"{value:.4g}" if isinstance(value, float) else str(value)
