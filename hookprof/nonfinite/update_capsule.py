"""The capsule of an update run again (issue 43 item 1: each anomaly kind its own capsule).

An update ratio jump is made by the optimizer's step, so its capsule holds what that step
began from, not the forward's inputs: for the parameters whose update the step measured
(efficiency/updates.py: the layers' turn), their values before the update, their gradients,
their optimizer state and their parameter group's hyperparameters (the learning rate as the
update began), the optimizer's class and the GradScaler values a fused optimizer was given,
with the bit sums of each parameter after the step's update and after the second run's
(integrity/update_replay.py). `hookprof replay CAPSULE` runs the update again from it in
another process, on another device or the CPU (update_reproduce.py): the third answer.

Written, with Config.capsule_dir and spike_replay, for a measured step whose update differed
from its second run (the machine is the suspect), or one where a layer's update ratio passed
the rule's current limit (publish/spikes.py `layer_limits`: a jump may have begun; the
gradients or the hyperparameters are the suspect, and the capsule holds them). Its values
are read on the host once the device has delivered them (no wait: a later step's end), so a
capsule is decided without a sync; the copies it holds are kept until then. Writing one
copies them to the host, which waits for the device: once per capsule written. It shares the
process's `capsule_max_count` with every other capsule (a reproduced update's never takes the
last slot, kept for a NaN's or a difference's) and its size cap (`capsule_max_bytes`: above
it none is written, and one line says so). A fault here costs the capsule only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookprof.config import Config
from hookprof.faults import Faults
from hookprof.nonfinite.capsule import (
    FORMAT,
    _saved,
    capsule_path,
    class_name,
    tensor_bytes,
    to_cpu,
)
from hookprof.nonfinite.check_capsule import (
    backends,
    slot_or_said,
    where_written,
    write_in_slot,
)

FORM_UPDATE = "update"  # the capsule's form (reproduce.py hands it to update_reproduce.py)


class UpdateCapsules:
    """Writes the capsule of a measured update (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        model: str,
        rank: int,
        faults: Faults,
        say: Callable[[str, str], None],
    ):
        assert config.capsule_dir is not None
        self._dir = config.capsule_dir
        self._max_count = config.capsule_max_count
        self._max_bytes = config.capsule_max_bytes
        self._model, self._rank = model, rank
        self._faults, self._say = faults, say

    def keep(
        self,
        *,
        step: int,
        kept: Sequence[dict[str, Any]],
        compared: Sequence[tuple[int, str, int, int]],
        first: int | None,
        jumped: Sequence[tuple[str, float, float]],
        deterministic: bool,
        uncalibrated: bool = False,
    ) -> str | None:
        """Step `step`'s measured update: `kept`, what each optimizer's update began from
        (update_replay.py `update_began`: parameters by their table position); `compared`,
        (position, name, bit sum after the step's update, after the second run's) of each
        parameter compared, in order; `first`, the first of them that differs (None: all
        alike); `jumped`, (layer, ratio, the rule's limit) of the layers above it;
        `uncalibrated`: the runs differed, but no second run has reproduced in this run yet
        (`first` None: no machine blamed). Returns the capsule's path, or None (said, or
        counted as a fault)."""
        with self._faults.contain("update replay capsule", disable=False):
            # a reproduced update's never takes the last slot (kept for a NaN's)
            if not slot_or_said(
                self._max_count, first is None, self._say, "update", step, "update"
            ):
                return None
            path = capsule_path(self._dir, self._model, self._rank, step)
            if not write_in_slot(
                path,
                lambda: self._contents(
                    step, kept, compared, first, jumped, deterministic, uncalibrated
                ),
            ):
                return None
            if first is not None:
                verdict = (
                    f"differed from its second run (first differing: {compared[first][1]}: "
                    "suspect "
                    "the machine)"
                )
            else:
                verdict = (
                    "differed from its second run before any second run reproduced in this "
                    "run (not blamed on the machine), "
                    if uncalibrated
                    else "was made again bit for bit by its second run, "
                ) + ", ".join(
                    f"{name}'s update ratio {ratio:.3g} above the rule's limit {limit:.3g}"
                    for name, ratio, limit in jumped
                )
                verdict += " (its gradients and hyperparameters are in the capsule)"
            self._say(
                f"update replay capsule {path}",
                f"the update of step {step} {verdict}; capsule written to {path} (hookprof "
                f"replay {path} runs the update in another process, on another device or the "
                "CPU)",
            )
            return path
        return None

    def _contents(
        self,
        step: int,
        kept: Sequence[dict[str, Any]],
        compared: Sequence[tuple[int, str, int, int]],
        first: int | None,
        jumped: Sequence[tuple[str, float, float]],
        deterministic: bool,
        uncalibrated: bool,
    ) -> dict[str, Any] | None:
        """The capsule (None above capsule_max_bytes, said)."""
        size = sum(tensor_bytes(inputs["params"]) for inputs in kept)
        if size > self._max_bytes:
            self._say(
                "update capsule too large",
                f"no capsule written for the update of step {step}: its parameters, gradients "
                f"and optimizer state ({size} bytes) are above capsule_max_bytes="
                f"{self._max_bytes}",
            )
            return None
        sums = {position: (name, ours, theirs) for position, name, ours, theirs in compared}
        position_of = {}  # the table's position of a parameter -> its place in the capsule
        params: list[dict[str, Any]] = []
        optimizers: list[dict[str, Any]] = []
        devices = set()
        # note: a CPU-GPU sync point: the copies to the host (to_cpu) wait for the device, on
        # a step that writes a capsule only (at most capsule_max_count per process)
        for inputs in kept:
            for position, value, grad, state in inputs["params"]:
                position_of[position] = len(params)
                devices.add(value.device)
                name, ours, theirs = sums[position]
                params.append(
                    {
                        "name": name,
                        # its bits summed after the step's update, and after the second run's
                        "after": ours,
                        "again": theirs,
                        "value": to_cpu(value),
                        "grad": to_cpu(grad),
                        # (which state tensors lay on the parameter's device: Adam's step
                        # count lies on the CPU unless capturable or fused)
                        "state": to_cpu(state),
                        "on_device": sorted(
                            key
                            for key, v in state.items()
                            if isinstance(v, torch.Tensor) and v.device == value.device
                        ),
                    }
                )
            optimizer = inputs["optimizer"]
            optimizers.append(
                {
                    "class": class_name(type(optimizer)),
                    "defaults": dict(optimizer.defaults),
                    "groups": [
                        {
                            "hyper": to_cpu(hyper),
                            # (a tensor learning rate on the device, for a capturable or
                            # fused update: moved back there to run it again)
                            "on_device": sorted(
                                key
                                for key, v in hyper.items()
                                if isinstance(v, torch.Tensor) and v.device.type != "cpu"
                            ),
                            "params": [position_of[p] for p in positions],
                        }
                        for hyper, positions in inputs["groups"]
                    ],
                    "attributes": to_cpu(inputs.get("attributes", {})),
                }
            )
        view = {
            "form": FORM_UPDATE,
            "kind": "update replay",
            "step": step,
            "model": self._model,
            "rank": self._rank,
            **where_written(devices, any(d.type == "cuda" for d in devices)),
            "deterministic": deterministic,
            "backends": backends(),
            "optimizers": [o["class"] for o in optimizers],
            "first_parameter": None if first is None else compared[first][1],
            "jumped": [
                {"layer": name, "ratio": ratio, "limit": limit} for name, ratio, limit in jumped
            ],
            "sizes": {"update_bytes": size, "max_bytes": self._max_bytes},
            "event": {
                "replay": "not_calibrated"
                if uncalibrated
                else "reproduced"
                if first is None
                else "not_reproduced",
                "layer": None if first is None else compared[first][1],
            },
        }
        return {
            "format": FORMAT,
            "view": view,
            # (torch.save of its own: hyperparameters may hold any object of the loop's,
            # loaded when the update is run again, with its failure named)
            "update": _saved(
                {
                    "params": params,
                    "optimizers": optimizers,
                    "first": None if first is None else position_of[compared[first][0]],
                }
            ),
        }


def update_capsules(
    config: Config, model: str, rank: int, faults: Faults, say: Callable[[str, str], None]
) -> UpdateCapsules | None:
    """The capsules of measured updates, with spike_replay and capsule_dir set."""
    if not config.spike_replay or config.capsule_dir is None:
        return None
    return UpdateCapsules(config, model=model, rank=rank, faults=faults, say=say)
