"""Metric families of the step phases, the training thread's position and the stall watch
(docs/stalls.md lists them), rendered from a Snapshot at scrape time like the rest."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from hookprof.phases.clock import OUTSIDE_NAME, PHASES
from hookprof.snapshot import Snapshot

# hookprof_progress_phase's value: the phase's order in a step, so that PromQL can tell which
# rank is behind (step * 8 + phase); "outside" (between steps) comes before a step's data
PHASE_ORDER = {**{name: i for i, name in enumerate(PHASES)}, OUTSIDE_NAME: -1}


def progress_families(snap: Snapshot, rank: str) -> list[Metric]:
    phases = SummaryMetricFamily(
        "hookprof_step_phase_seconds",
        "Host seconds of each step spent per phase: data (previous step's end to the first "
        "root forward), forward, backward, optimizer, other; every step (docs/stalls.md)",
        labels=["rank", "phase"],
    )
    for phase in PHASES:
        phases.add_metric([rank, phase], snap.phase_steps, snap.phase_seconds.get(phase, 0.0))
    families: list[Metric] = [phases]
    if snap.device_phase_seconds is not None:  # a device timer (CUDA): absent on the CPU
        device = SummaryMetricFamily(
            "hookprof_step_phase_device_seconds",
            "Device seconds of sampled steps per phase: the CUDA stream's progress between the "
            "host's phase boundaries (work enqueued in a phase, or the device idling for the "
            "host); only with CUDA events, absent on the CPU where it would equal "
            "hookprof_step_phase_seconds (docs/stalls.md)",
            labels=["rank", "phase"],
        )
        for phase in PHASES:
            device.add_metric([rank, phase], snap.device_phase_steps, snap.device_phase_seconds.get(phase, 0.0))
        families.append(device)
    stalled = GaugeMetricFamily(
        "hookprof_stalled",
        "1 while the training thread's current phase has lasted longer than the stall "
        "threshold learned for it (hookprof_stall_info says where)",
        labels=["rank"],
    )
    stalled.add_metric([rank], 1.0 if snap.stall is not None else 0.0)
    stalls = CounterMetricFamily("hookprof_stalls", "Stalls seen since attach", labels=["rank"])
    stalls.add_metric([rank], snap.stalls)
    families += [stalled, stalls]

    if snap.progress is not None:
        where = snap.progress
        step = GaugeMetricFamily(
            "hookprof_progress_step", "The step in progress (steps completed + 1)", labels=["rank"])
        step.add_metric([rank], where.step)
        phase = GaugeMetricFamily(
            "hookprof_progress_phase",
            "The training thread's current phase (label); the value is its order in a step "
            "(data 0, forward 1, backward 2, optimizer 3, other 4, outside a step -1)",
            labels=["rank", "phase"],
        )
        phase.add_metric([rank, where.phase], PHASE_ORDER.get(where.phase, -1))
        seconds = GaugeMetricFamily(
            "hookprof_progress_phase_seconds",
            "Seconds the training thread has been in its current phase",
            labels=["rank"],
        )
        seconds.add_metric([rank], where.phase_seconds)
        families += [step, phase, seconds]

    if snap.stall is not None:
        stall = snap.stall
        info = GaugeMetricFamily(
            "hookprof_stall_info",
            "The stall going on now: step, phase, innermost layer on the training thread's "
            "stack, and what it waits on (collective, data, device, code)",
            labels=["rank", "step", "phase", "layer", "waiting_on"],
        )
        info.add_metric([rank, str(stall.step), stall.phase, stall.layer, stall.waiting_on], 1)
        families.append(info)
    return families
