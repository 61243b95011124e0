"""Incident capsules made by real training runs (issue 31), for the tests that open them or
replay them: the first-NaN scenarios (support.first_nan) trained with Config.capsule_dir set,
and a model whose producer's class cannot be imported by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hookprof
from support.first_nan import UNSAMPLED, Run, Scenario, run


def capsule_of(
    scenario: Scenario, directory: Path, *, lag: int = 0, policy: str = "record", **more: Any
) -> tuple[Run, str]:
    """Train `scenario` with capsules on; (the run, the capsule's path from its snapshot)."""
    r = run(
        scenario,
        lag=lag,
        policy=policy,
        steps=scenario.steps(lag),
        capsule_dir=str(directory),
        **more,
    )
    event = r.snapshot.first_nonfinite
    assert event is not None and event.capsule is not None, event
    return r, event.capsule


def local_producer_capsule(directory: Path, bad_step: int = 3) -> tuple[torch.Tensor, str]:
    """A model whose classes are defined in this function (not importable by name): its
    producer `scale` (exp of its input times a parameter) overflows on a row of 100s.
    Returns (the producer's `gain` as the bad step's forward used it, the capsule's path)."""

    class LocalExp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return torch.exp(x * self.gain)

    class LocalNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = LocalExp()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.scale(x))

    torch.manual_seed(0)
    model = LocalNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    config = hookprof.Config(summary_at_exit=False, capsule_dir=str(directory)).replace(**UNSAMPLED)
    with hookprof.attach(model, config=config) as prof:
        for step in range(1, bad_step + 3):
            x = torch.randn(4, 8, generator=g) * 0.1
            if step == bad_step:
                x[0] = 100.0  # exp(100) is above float32's max: Inf
                gain = model.scale.gain.detach().clone()
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
        prof.flush()
        event = prof.snapshot().first_nonfinite
    assert event is not None and event.capsule is not None, event
    return gain, event.capsule


ROOT = Path(__file__).resolve().parents[2]


def replay_in_new_process(path: str, *args: str) -> subprocess.CompletedProcess:
    """`hookprof replay` in a new process, with the tests' models importable (as the user's
    model code must be) and nothing of the training process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKPROF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    return subprocess.run(
        [sys.executable, "-m", "hookprof.cli", "replay", path, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
