"""The reaction to a NaN/Inf: noticing it, keeping the incident open, the on_nonfinite policies.

New non-finite steps are noticed at step boundaries; an incident stays open (every step
sampled) until its layer is known; the first one is acted on by the configured policy."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hookprof.config import Config, Policy
from hookprof.device import transfer
from hookprof.errors import NonFiniteError
from hookprof.faults import Faults, log
from hookprof.files import safe_label, write_atomic
from hookprof.nonfinite.capsule import Capsules, describe_capsule
from hookprof.nonfinite.detector import Detector
from hookprof.snapshot import (
    FoundBy,
    NonFiniteEvent,
    ReplayOutcome,
    Snapshot,
)


class PublisherLike(Protocol):
    """What the reaction needs of publish.publisher.Publisher, named here rather than imported:
    a feature package may not import the publish layer above it (tests/unit/test_layering.py)."""

    latest: Snapshot

    def flush(self, timeout: float | None = ...) -> bool: ...

    def publish_now(self) -> int: ...

    def settle(self) -> bool: ...


MAX_DUMP_TRIES = 3  # writes of the "dump" report a run tries, when they fail
HOLD_STEPS = 8  # step ends the policy may wait for the replay to name the layer (replay.MAX_LATE)


class IncidentResponse:
    """Owns the NaN reaction of one profiler. The training thread calls `at_step_end` at
    each step boundary and asks `open` when planning a step; nothing else writes its state.

    Under "record" the news comes with each sampled step's drain of the device counters;
    the other policies read one flag per step back from the device, without waiting for it,
    and bring the counters over as soon as it shows something new."""

    def __init__(
        self,
        config: Config,
        rank: int,
        detector: Detector,
        publisher: PublisherLike,
        drain_counters: Callable[[], None],
        replay_pending: Callable[[int], bool] = lambda step: False,
        *,
        model: str = "model",
        faults: Faults | None = None,
        capsules: Capsules | None = None,
    ):
        self._config = config
        self._capsules = capsules  # the incident capsule (Config.capsule_dir), written from here
        self._rank = rank
        self._model = model  # the profiler's `model` label: the dump's file name carries it
        # a dump that cannot be written is a fault of the dump alone (reported with
        # disable=False): NaN detection and step counting go on (DESIGN.md invariant 3)
        self._faults = faults if faults is not None else Faults()
        self._dump_tries = 0  # failed dumps are tried again at later incidents, a few times
        self._detector = detector
        self._publisher = publisher
        self._drain_counters = drain_counters
        self._known_bad = 0  # non-finite steps already reacted to
        self.open_until = 0  # sample every step up to this step number (read at every step's start)
        self._acted = False  # the policy acts once per run: the first incident matters
        self._flags: list[tuple[torch.device, transfer.Copy]] = []  # device flags in flight
        self._device_bad: dict[torch.device, int] = {}  # last flag read back per device
        self._drained_at = 0  # the count of bad steps seen when the counters were last drained
        # can the forward replay still name the producer of this bad step (its flag or its
        # packet on the way)? Then the policy waits for it, up to HOLD_STEPS step ends
        self._replay_pending = replay_pending
        self._act_by: int | None = None  # the last step end at which the held policy acts

    def open(self, step: int) -> bool:
        """Is an incident open at `step`: recent, and its layer not known yet?"""
        if step > self.open_until:
            return False
        event = self._publisher.latest.first_nonfinite
        return event is None or event.layer is None

    def at_step_end(self, step: int) -> None:
        """Notice new non-finite steps and act on them (may raise NonFiniteError)."""
        policy = self._config.on_nonfinite
        if policy != Policy.RECORD:
            self._poll_flag()
            if self._act_by is not None or self._drained_at > self._known_bad:
                # a drain or a replay this policy waits for: folded now if the device has
                # caught up with it (the publisher's Python work only, never a device wait)
                self._publisher.settle()
        snap = self._publisher.latest
        if self._capsules is not None:
            self._capsule_when_settled(snap)
        bad = sum(snap.nonfinite_steps.values())
        if bad <= self._known_bad:
            if self._act_by is not None:
                self._act_when_named(step, snap)
            return
        self._known_bad = bad
        self.open_until = step + self._config.incident_steps
        if (
            policy != Policy.RECORD
            and snap.first_nonfinite is not None
            and not self._acted
            and self._act_by is None
        ):
            self._act_by = step + HOLD_STEPS
        if self._act_by is not None:
            self._act_when_named(step, snap)

    def _act_when_named(self, step: int, snap: Snapshot) -> None:
        """Act on the first incident, once its layer is known or cannot be anymore: while
        the forward replay may still name it (a kept step's flag or the replay's packet on
        its way), at most HOLD_STEPS step ends. Holding is safe: the replay is pending only
        for steps whose update the guard held back (guard.py), and it holds back every
        non-finite update meanwhile."""
        event = snap.first_nonfinite
        assert event is not None and self._act_by is not None
        if event.layer is None and step < self._act_by and self._replay_pending(event.step):
            return
        # the replay may have been published since `snap` was read (its token is set after
        # `latest`): act on the newest snapshot, which then names the layer
        snap = self._publisher.latest
        self._act(snap.first_nonfinite or event, snap, self._config.on_nonfinite)

    def _act(self, event: NonFiniteEvent, snap: Snapshot, policy: str) -> None:
        """Carry out `policy` on the first incident, once, with its capsule's path."""
        event = self._with_capsule(event)
        self._act_by = None
        self._acted = True
        if policy == Policy.DUMP:
            self._dump(event, snap)
        else:
            apply(policy, event, snap, self._config, self._rank, model=self._model)

    def at_detach(self) -> None:
        """The run ends, and no later step end will come: a first incident the policy has not
        acted on (held for the replay to name the layer, or not seen by a step end yet) is
        acted on now, with what is known, and a capsule still waiting is written. Under "raise"
        nothing is raised out
        of detach(): the incident is said as under "warn"."""
        capsules = self._capsules
        waiting = capsules is not None and capsules.draft is not None
        # only an incident already known on the host: detach never waits on the device to
        # find one (a flag still on its way stays there)
        policy_open = (
            self._config.on_nonfinite != Policy.RECORD
            and not self._acted
            and (self._act_by is not None or self._publisher.latest.first_nonfinite is not None)
        )
        if not (policy_open or waiting):
            return
        if waiting:  # the capsule needs its incident's replay folded (an opt-in wait)
            self._publisher.flush()
        snap = self._publisher.latest
        if policy_open and snap.first_nonfinite is not None:
            # held for the replay, or seen by a flush() after the last step end (a device
            # behind the host: the last steps' flags arrived after it)
            policy = self._config.on_nonfinite
            self._act(snap.first_nonfinite, snap, Policy.WARN if policy == Policy.RAISE else policy)
        if self._capsule_when_settled(self._publisher.latest):
            self._publisher.flush()  # the snapshot carries its path

    def flushed(self, done: bool, detached: bool, timeout: float | None = 10.0) -> bool:
        """Profiler.flush() returned `done`: a capsule waiting for its incident to settle is
        written now (the run may end here: no later step end would write it), and the
        snapshot brought up to it (a second wait, bounded by `timeout` like the first)."""
        if not detached and self._capsule_when_settled(self._publisher.latest):
            done = self._publisher.flush(timeout) and done  # the snapshot carries its path
        return done

    def _capsule_when_settled(self, snap: Snapshot) -> bool:
        """Write the capsule once the first NaN/Inf is settled: its replay's verdict known
        (or it is another step's). A policy still holding for the replay writes it when it
        acts (`_with_capsule`), so that its log line or exception gives the path; under
        "record", or after the policy acted, its own log line does. True when a write was
        tried: the snapshot is to be brought up to it (its path, or the failure counted in
        hookprof_internal_errors_total: issue 39, a failure used to wait for the next flush)."""
        capsules, event = self._capsules, snap.first_nonfinite
        if capsules is None or event is None or self._act_by is not None:
            return False
        if capsules.draft is None:
            if event.replay is not None or event.phase != "forward":  # settled, and nothing kept
                capsules.missing(event)
            return False
        if (
            event.step == capsules.draft.step
            and event.replay is None
            and capsules.draft.kind == "forward"
        ):
            return False  # the replay's packet is not folded yet
        if self._config.on_nonfinite != Policy.RECORD and not self._acted:
            return False  # the policy writes it as it acts
        path = capsules.write(
            event, model=self._model, rank=self._rank, summary=describe(event, self._rank)
        )
        if path is not None:
            log.warning(
                "hookprof: %s", describe(dataclasses.replace(event, capsule=path), self._rank)
            )
        return True

    def _with_capsule(self, event: NonFiniteEvent) -> NonFiniteEvent:
        """`event` with its capsule's path, the capsule written now if it waits."""
        capsules = self._capsules
        if capsules is None:
            return event
        path = capsules.path
        if capsules.draft is not None:
            path = capsules.write(
                event, model=self._model, rank=self._rank, summary=describe(event, self._rank)
            )
        return dataclasses.replace(event, capsule=path) if path is not None else event

    def _dump(self, event: NonFiniteEvent, snap: Snapshot) -> None:
        """The "dump" policy, contained: a report that cannot be written (a full disk, a
        dump_dir under a file) is counted in hookprof_internal_errors_total and said in the
        log with its path, and costs only the report. The next new non-finite step tries
        again, up to MAX_DUMP_TRIES writes in all."""
        self._dump_tries += 1
        try:
            apply(Policy.DUMP, event, snap, self._config, self._rank, model=self._model)
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C in a notebook loop that goes on
            self._acted, self._act_by = False, 0  # written again at the next step end, or detach()
            self._dump_tries -= 1  # (no failure of the disk: not one of MAX_DUMP_TRIES)
            log.warning(
                "hookprof: the report of the NaN/Inf of step %s was interrupted (%s) before it "
                "was written: it is written at the next step end, or at detach()",
                event.step,
                type(exc).__name__,
            )
            raise
        except Exception as exc:  # OSError mostly; whatever it is, it costs only the report
            path = dump_path(self._config.dump_dir, self._model, self._rank, event.step)
            again = self._dump_tries < MAX_DUMP_TRIES
            self._acted = not again  # not acted yet: a later incident writes its report
            if self._dump_tries == 1:  # the incident and the failure, said once
                log.warning(
                    "hookprof: %s; the report could not be written to %s: %s%s",
                    describe(event, self._rank),
                    path,
                    getattr(exc, "strerror", None) or exc,
                    "; tried again at the next new non-finite step" if again else "",
                )
            self._faults.report(f"nonfinite dump ({path})", exc, disable=False)

    def _poll_flag(self) -> None:
        for device, c in self._detector.by_device.items():
            self._flags.append((device, transfer.peek(c.phase_bad.sum().reshape(1))))
        while self._flags and transfer.is_ready(self._flags[0][1].ready):
            device, (host, _) = self._flags.pop(0)
            # a host tensor whose copy has completed: no sync; counts are cumulative
            self._device_bad[device] = int(host.sum())
        seen = self._detector.host_total() + sum(self._device_bad.values())
        if seen > self._known_bad and seen > self._drained_at:
            # something went bad: bring the counters over now so layer, phase and step are known
            self._drained_at = seen
            self._drain_counters()
            if all(transfer.on_host(c.flat) for c in self._detector.by_device.values()):
                # everything is on the host already: folding it is the publisher's Python
                # work, not a wait for a device, so the policy acts at this very step
                self._publisher.flush()
            else:
                # never wait for the device here: the publisher folds the drain as soon as
                # its copy completes (waiting for it on its own thread) and publishes at
                # once, and the policy acts at the first step end after that (the update
                # guard has held this step's update back meanwhile)
                self._publisher.publish_now()


def describe(event: NonFiniteEvent, rank: int) -> str:
    """The first NaN/Inf in words: where, how it was found, and what its replay said
    (docs/nonfinite.md, "What hookprof says"). The one wording of the log line, the
    exception, the report and the dump."""
    text = f"NaN/Inf in the {event.phase} phase at step {event.step} on rank {rank}, first in "
    text += origin(event)
    if event.last_finite_child:
        text += f", after its child {event.last_finite_child} ran finite"
    if event.propagators:
        text += f" (then {', '.join(event.propagators[:5])}{' ...' if len(event.propagators) > 5 else ''})"
    return text + replay_words(event, rank) + describe_capsule(event.capsule)


def origin(event: NonFiniteEvent) -> str:
    """Where the NaN was made, and how hookprof knows."""
    if event.layer is None:
        if event.replay == ReplayOutcome.TRANSIENT:
            return "no layer: it did not happen again when the step was replayed"
        if event.replay == ReplayOutcome.NOT_REPLAYED:
            return "a layer that cannot be named: the step was not replayed"
        if event.replay == ReplayOutcome.REPRODUCIBLE:
            return f"a layer that cannot be named: {event.replay_note}"
        return "a layer not yet localised"
    if event.found_by == FoundBy.WEIGHTS:
        return f"{event.layer}: its weights are non-finite (before any non-finite update)"
    if event.found_by == FoundBy.INPUT:
        return f"{event.layer}: the batch already held it"
    how = {
        FoundBy.SAMPLED: "seen on that sampled step",
        FoundBy.REPLAY: "seen when the step was replayed",
        FoundBy.BACKWARD: "its gradient went non-finite first",
        FoundBy.LOSS: "the loss alone",
    }
    return f"layer {event.layer}" + (f" ({how[event.found_by]})" if event.found_by in how else "")


def replay_words(event: NonFiniteEvent, rank: int) -> str:
    """What the replay of the step said, when it said something."""
    if event.replay == ReplayOutcome.REPRODUCIBLE:
        causes: dict[FoundBy | None, str] = {
            FoundBy.WEIGHTS: "its weights",
            FoundBy.INPUT: "the data",
        }
        cause = causes.get(event.found_by, "the data or the model")
        return f"; reproducible: a replay with the same inputs, weights and RNG made it again ({cause})"
    if event.replay == ReplayOutcome.TRANSIENT:
        where = f"rank {rank} on {socket.gethostname()}, device {event.device}"
        named = " the sampled step's checks saw it, but" if event.layer is not None else ""
        return (
            f";{named} transient: a replay with the same inputs, weights and RNG was finite "
            f"(a non-deterministic kernel, a race, or the hardware: suspect {where})"
        )
    if event.replay == ReplayOutcome.NOT_REPLAYED:
        return f"; not replayed: {event.replay_note}"
    return ""


def apply(
    policy: str,
    event: NonFiniteEvent,
    snap: Snapshot,
    config: Config,
    rank: int,
    *,
    model: str = "model",
) -> str | None:
    """Act on the first incident of a run. Returns the report's path under "dump" (raises
    OSError when it cannot be written: IncidentResponse contains that)."""
    if policy == Policy.WARN:
        log.warning("hookprof: %s", describe(event, rank))
    elif policy == Policy.SKIP:
        log.warning(
            "hookprof: %s; the update of every non-finite step is held back "
            "(hookprof_held_back_updates_total counts them)",
            describe(event, rank),
        )
    elif policy == Policy.RAISE:
        raise NonFiniteError(
            event.layer,
            event.phase,
            event.step,
            rank,
            found_by=event.found_by,
            replay=event.replay,
            message=describe(event, rank),
        )
    elif policy == Policy.DUMP:
        path = write_report(event, snap, config.dump_dir, rank, model=model)
        log.warning("hookprof: %s; report written to %s", describe(event, rank), path)
        return path
    return None


def _plain(value: Any) -> Any:
    """JSON has no NaN/Inf: they are written as strings, which is what a report is about."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dump_path(directory: str, model: str, rank: int, step: int) -> str:
    """The dump's file: model, rank, process and step, so that two models of one process, or
    processes of one rank (several jobs, a restarted job) sharing dump_dir, never write one
    file. A model name that is not a plain file name is made one (with a short hash of the
    real name, so that two names never become one)."""
    return os.path.join(
        directory,
        f"hookprof-nonfinite-{safe_label(model)}-rank{rank}-pid{os.getpid()}-step{step}.json",
    )


def write_report(
    event: NonFiniteEvent, snap: Snapshot, directory: str, rank: int, *, model: str = "model"
) -> str:
    """The incident's JSON report in `directory` (made if missing), written whole or not at
    all (files.write_atomic); returns its path. Raises OSError when it cannot be written."""
    path = dump_path(directory, model, rank, event.step)
    report = {
        "summary": describe(event, rank),
        "model": model,
        "rank": rank,
        "pid": os.getpid(),
        "written_at": time.time(),
        "incident": dataclasses.asdict(event),
        "step": snap.step,
        "nonfinite_steps": dict(snap.nonfinite_steps),
        "loss": snap.loss,
        "grad_norm": snap.grad_norm,
        "layers": {
            name: {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
            for name, stats in snap.layers.items()
        },
    }
    return write_atomic(path, json.dumps(_plain(report), indent=2), make_dirs=True)
