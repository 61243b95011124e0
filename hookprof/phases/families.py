"""Metric families of the step phases, the training thread's position and the stall watch
(docs/stalls.md; names in hookprof/metrics_names.py), rendered from a Snapshot at scrape
time like the rest."""

from __future__ import annotations

from prometheus_client.core import Metric

from hookprof import metrics_names as names
from hookprof.metrics_names import family
from hookprof.phases.clock import OUTSIDE_NAME, PHASES
from hookprof.snapshot import Snapshot

# hookprof_progress_phase's value: the phase's order in a step, so that PromQL can tell which
# rank is behind (step * 8 + phase); "outside" (between steps) comes before a step's data
PHASE_ORDER = {**{name: i for i, name in enumerate(PHASES)}, OUTSIDE_NAME: -1}


def progress_families(snap: Snapshot, rank: str) -> list[Metric]:
    phases = family(names.STEP_PHASE_SECONDS)
    for phase in PHASES:
        phases.add_metric([rank, phase], snap.phase_steps, snap.phase_seconds.get(phase, 0.0))
    families: list[Metric] = [phases]
    if snap.device_phase_seconds is not None:  # a device timer (CUDA): absent on the CPU
        device = family(names.STEP_PHASE_DEVICE_SECONDS)
        for phase in PHASES:
            device.add_metric(
                [rank, phase], snap.device_phase_steps, snap.device_phase_seconds.get(phase, 0.0)
            )
        families.append(device)
    stalled = family(names.STALLED)
    stalled.add_metric([rank], 1.0 if snap.stall is not None else 0.0)
    stalls = family(names.STALLS_TOTAL)
    stalls.add_metric([rank], snap.stalls)
    families += [stalled, stalls]

    if snap.progress is not None:
        where = snap.progress
        step = family(names.PROGRESS_STEP)
        step.add_metric([rank], where.step)
        phase = family(names.PROGRESS_PHASE)
        phase.add_metric([rank, where.phase], PHASE_ORDER.get(where.phase, -1))
        seconds = family(names.PROGRESS_PHASE_SECONDS)
        seconds.add_metric([rank], where.phase_seconds)
        families += [step, phase, seconds]

    if snap.stall is not None:
        stall = snap.stall
        info = family(names.STALL_INFO)
        info.add_metric([rank, str(stall.step), stall.phase, stall.layer, stall.waiting_on], 1)
        families.append(info)
    return families
