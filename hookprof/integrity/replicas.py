"""The scheduled replica check (Config.sdc_check_interval_s, off by default): every so often,
at a step number every data-parallel replica chooses alike, the fingerprint of the parameters
after the update (integrity/fingerprint.py) is taken on the device and sent with the step's
own copy; each rank exports it with the step (`hookprof_parameter_fingerprint`,
`hookprof_parameter_fingerprint_step`), and Prometheus compares the replicas
(deploy/prometheus/hookprof-rules.yml, HookprofReplicaParametersDiffer: the rank whose
fingerprint differs from the others', by majority; HookprofReplicasDisagree: the replicas hold
more than one fingerprint at one step, which two replicas can tell but not whose is wrong).
Nothing is exchanged between ranks in the training process: no collective that could hang.

Which steps: the multiples of a power of two of steps that lasts the interval at the run's
mean step time (step/plan.py `aligned_period`, as aligned sampling chooses its period), so
ranks of one synchronous job check the same steps, and two ranks whose estimates straddle a
power of two still share every other check.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookprof.distributed import with_other_ranks
from hookprof.integrity.fingerprint import (
    device_fingerprints,
    halves,
    replica_group,
    run_identity,
)
from hookprof.step.plan import aligned_period

SHARDED_REPLICA_NOTICE = (
    "sdc_check_interval_s is set on a model whose parameters are DTensors (FSDP2, tensor "
    "parallel): each rank fingerprints its own shard, and shards differ by design, so "
    "HookprofReplicasDisagree will fire; the replica check is for data-parallel replicas "
    "(docs/integrity.md)"
)

# on_nonfinite "skip"/"raise" decide per rank: a NaN one rank's loss never reads (an output
# it drops) holds back that rank's update alone, and the replicas then differ by design
HELD_BACK_REPLICA_NOTICE = (
    "sdc_check_interval_s is set with on_nonfinite 'skip' or 'raise' on one rank of several: "
    "an update held back on one rank alone (a NaN that never reached the all-reduced "
    "gradients) makes its parameters differ from its replicas', and the replica check will "
    "say so (hookprof_held_back_updates_total tells such a rank; docs/integrity.md)"
)


class ReplicaCheck:
    """What the check reads and when (see the module's docstring)."""

    @classmethod
    def for_model(
        cls, model: nn.Module, config: Any, sharded: bool, say: Callable[[str, str], None]
    ) -> ReplicaCheck | None:
        """The check of Config.sdc_check_interval_s for `model` (None: off), in the run this
        process is a rank of; says where the replicas will differ by design."""
        if config.sdc_check_interval_s is None:
            return None
        process = f"{socket.gethostname()}:{os.getpid()}:{id(model)}:{time.time_ns()}"
        check = cls(
            model,
            config.sdc_check_interval_s,
            run_identity(os.environ, process),
            config.sdc_replica_group,
        )
        if sharded:
            say("replica check", SHARDED_REPLICA_NOTICE)
        elif config.on_nonfinite in ("skip", "raise") and with_other_ranks():
            say("replica check", HELD_BACK_REPLICA_NOTICE)
        return check

    def __init__(self, model: nn.Module, interval_s: float, run: str, group: str = ""):
        """`run`: fingerprint.run_identity(); `group`: Config.sdc_replica_group."""
        self._model = weakref.ref(model)
        self.group = replica_group(list(model.named_parameters()), run, group)
        self._interval_ns = int(interval_s * 1e9)
        self.period = 1  # the check steps are its multiples
        self.step: int | None = None  # the check step planned (due), until the next is
        self._origin: tuple[int, int] | None = None  # (step, ns) the mean step time counts from
        self._weights: dict[Any, torch.Tensor] = {}

    def due(self, number: int, now_ns: int) -> bool:
        """Is step `number`, about to begin at `now_ns`, a check step? (Kept in `step`. The
        first call only starts the clock: its step holds the warm-up.)"""
        self.step = None
        if self._origin is None:
            self._origin = (number, now_ns)
            return False
        first, first_ns = self._origin
        if number <= first:
            return False
        step_ns = (now_ns - first_ns) / (number - first)  # the mean of the steps since
        self.period = aligned_period(1, self._interval_ns, step_ns, self.period)
        if number % self.period:
            return False
        self.step = number
        return True

    def take(self) -> list[torch.Tensor]:
        """The parameters' fingerprint now, as each device's two halves (float64, on its
        device: nothing is read back). The parameters are the model's as of now: a
        checkpoint loaded with `load_state_dict(assign=True)` replaces them."""
        model = self._model()
        params = [p for _, p in model.named_parameters()] if model is not None else []
        return [halves(f) for f in device_fingerprints(params, self._weights)]
