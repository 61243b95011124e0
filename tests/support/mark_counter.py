"""Counting what one sampled step costs per instrumented leaf, in units that do not depend
on the machine: timer marks (each one a CUDA event record on a GPU, ~3 us of host time on
an H100) and hook invocations (each one a Python call torch makes into hookprof), for
tests/unit/step/test_leaf_marks.py and bench/parts.py leaf-marks.

The timer is the CUDA event timer over support/fake_gpu.py's stand-in events, so the marks
counted are the ones a GPU run would record: the stand-in stream counts every record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import hookprof
from hookprof import _testing
from hookprof.device.timing import CudaEventTimer
from support.fake_gpu import FakeEvent, FakeStream


@dataclass
class LeafCount:
    layers: int  # instrumented leaves (and parents) in the model
    forward_calls: int  # their training calls on the step
    marks: int  # every event recorded from the step's first mark to the end of its backward
    forward_marks: int  # start and end of each call
    outer_marks: int  # around calls with an instrumented parent
    node_marks: int  # autograd node pre-hooks (gradient ready at a layer's output or input)
    param_marks: (
        int  # post-accumulate-grad hooks (backward end of layers without an input gradient)
    )
    step_marks: int  # per step, not per layer: the step's phase boundaries (device_phases.py)
    hook_calls: int  # Python calls torch made into hookprof's per-layer hooks

    @property
    def layer_marks(self) -> int:
        """The marks the per-layer hooks took (all but the step's own)."""
        return self.marks - self.step_marks

    @property
    def marks_per_leaf(self) -> float:
        return self.layer_marks / self.layers


def count_sampled_step(
    model: torch.nn.Module,
    step: Callable[[Callable[[torch.nn.Module], None]], object],
    *,
    warmup: int = 2,
    **config,
) -> LeafCount:
    """Marks and hook calls of one sampled step of `model`. `step(before_update)` runs one
    training step and calls `before_update(model)` between backward and the optimizer, where
    the step's record is complete (bench/shapes.Shape.step has that form)."""
    stream = FakeStream()
    timer = CudaEventTimer(event_factory=FakeEvent, current_stream=lambda: stream)
    cfg = hookprof.Config(**{"port": 0, "sample_every": 1, "min_sample_interval_s": 0.0, **config})
    prof = hookprof.Profiler(model, cfg, timer=timer)
    seen: dict[str, int] = {}
    try:
        for _ in range(warmup):  # the first sampled step installs the hooks mid-forward
            step(lambda m: None)
            prof.flush()

        def read(m: torch.nn.Module) -> None:
            rec = _testing.step_record(prof)
            seen["recorded"] = stream.recorded
            seen["calls"] = len(rec.calls)
            seen["forward"] = sum((c.start is not None) + (c.end is not None) for c in rec.calls)
            seen["outer"] = sum(
                (c.outer_start is not None) + (c.outer_end is not None) for c in rec.calls
            )
            seen["node"] = len(rec.grad_ready)
            seen["param"] = len(rec.param_done)
            seen["step"] = len(getattr(rec, "phase_marks", ()))  # a version without them: none

        # a step's first mark is taken as it begins (timer.start(), at the end of the step
        # before): counted from there
        first = stream.recorded - 1
        step(read)
        prof.flush()
    finally:
        prof.detach()
    return LeafCount(
        layers=len(prof.table),
        forward_calls=seen["calls"],
        marks=seen["recorded"] - first - 1,  # not the step's own start mark
        forward_marks=seen["forward"],
        outer_marks=seen["outer"],
        node_marks=seen["node"],
        param_marks=seen["param"],
        step_marks=seen["step"],
        # a wrapped forward or a pre/post hook pair: one Python call in, the enter and leave
        # methods behind it; a node pre-hook or a parameter hook: one call each
        hook_calls=seen["calls"] + seen["node"] + seen["param"],
    )
