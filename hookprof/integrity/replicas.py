"""The scheduled replica check (Config.sdc_check_interval_s, off by default): every so often,
at a step number every data-parallel replica chooses alike, the fingerprint of the parameters
after the update (integrity/fingerprint.py) is taken on the device and sent with the step's
own copy; each rank exports it with the step (`hookprof_parameter_fingerprint`,
`hookprof_parameter_fingerprint_step`), and Prometheus compares the replicas
(deploy/prometheus/hookprof-rules.yml, HookprofReplicaParametersDiffer: the rank whose
fingerprint differs from the others', by majority; HookprofReplicasDisagree: the replicas hold
more than one fingerprint at one step, which two replicas can tell but not whose is wrong).
Nothing is exchanged between ranks in the training process: no collective that could hang.

Two replicas that disagree cannot tell, from two values, whose parameters are wrong. So each
rank also watches its own parameters while they must stand still: each one's bits are summed
as the check step's first training forward begins (`hold`) and again as its first optimizer
update begins (`release`); between the two only the forward and backward ran, which read the
parameters and never write them. A parameter whose sum changed was written outside the
optimizer: by this rank's memory or device (silent data corruption), or by the loop's own
code through `.data`, which torch does not see. The rank names itself, whatever the number
of replicas, and the first parameter that changed (exported as
`hookprof_parameter_changes_outside_update_total` and `hookprof_parameter_change_info`;
alert HookprofParametersChangedOutsideUpdate). Left out: parameters that do not train (a
momentum encoder MoCo's forward updates), those a forward renormalises in place by design
(`nn.Embedding(max_norm=...)`), and any parameter the program wrote where torch sees it (its
version counter or its data's address moved, read on the host: an in-place op,
`param.data = ...`), which is the program's; a device's memory moves neither. Another model's
optimizer stepping inside the window (a GAN's) starts it again at the next forward. What the
window cannot see: a write between an update and the next forward (the loop's clamps and
loads belong there, so it is not watched) or one inside the update itself; of two replicas,
those are told only as a disagreement.

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
    Mark,
    changed_parameters,
    device_fingerprints,
    halves,
    parameter_sums,
    replica_group,
    run_identity,
    write_marks,
)
from hookprof.step.plan import aligned_period

# parameter_sums' per device: the parameters' positions, and their bits sums on the device
DeviceSums = tuple[list[int], torch.Tensor]

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
        # the parameters watched from the check step's forward to its update: their names and
        # identities, and their sums at the forward's start (None: not watching)
        self._held: tuple[list[tuple[str, int]], list[Mark], list[DeviceSums]] | None = None
        # per device, (how many changed, the first's position) once released, and the names
        # the positions are of; packed with the step's fingerprint
        self.changes: tuple[list[torch.Tensor], list[str]] | None = None

    def due(self, number: int, now_ns: int) -> bool:
        """Is step `number`, about to begin at `now_ns`, a check step? (Kept in `step`. The
        first call only starts the clock: its step holds the warm-up.)"""
        self.step = None
        self._held = self.changes = None  # (a step that ended without an update compares none)
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

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """The check step's first training forward begins: the watched parameters' bits summed
        (on the device), to be compared as its update begins."""
        names, params = self._watched()
        self._held = (
            list(zip(names, map(id, params))),
            write_marks(params),
            parameter_sums(params, squares=True),
        )

    def restart(self) -> None:
        """An optimizer that does not own the model stepped inside the window (a GAN's other
        model, steps ended by optimizers): what came before its update is another step's
        (the caller holds again at the next training forward)."""
        self._held = None

    def release(self) -> None:
        """The check step's first update begins: which watched parameters changed since its
        forward began (`changes`, on the device; nothing read back). Not compared (`changes`
        stays None): a parameter replaced meanwhile (another tensor under the same names).
        A parameter the program wrote where torch sees it (an in-place op, which moves its
        version counter, or new data assigned) is the program's, never counted: a device's
        memory moves no counter."""
        assert self._held is not None
        held, marks, before = self._held
        self._held = None
        names, params = self._watched()
        if list(zip(names, map(id, params))) != held:
            return
        untouched = [old == new for old, new in zip(marks, write_marks(params))]
        self.changes = (
            changed_parameters(before, parameter_sums(params, squares=True), untouched),
            names,
        )

    def _watched(self) -> tuple[list[str], list[torch.Tensor]]:
        """The parameters a forward and backward must leave as they are: the model's that
        train (a momentum encoder's, which MoCo's forward updates, do not), less those of
        embeddings that renormalise their rows in place (max_norm)."""
        model = self._model()
        if model is None:
            return [], []
        renormed = {
            id(p)
            for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
            for p in m.parameters(recurse=False)
        }
        kept = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in renormed
        ]
        return [n for n, _ in kept], [p for _, p in kept]
