"""`hookprof replay CAPSULE` in a fresh process (issue 31): a capsule written by a real
training run is re-run by the real command; its verdict line, exit status and ranges."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.capsules import ROOT, capsule_of, local_producer_capsule
from support.capsules import replay_in_new_process as replay
from support.first_nan import Overflow, TransientPoison


def test_overflowing_row_reproduces_on_the_cpu_and_names_the_layer(tmp_path):
    _, path = capsule_of(Overflow(at=5), tmp_path)
    done = replay(path, "--device", "cpu", "--runs", "2")
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[0] == "reproduced: NaN/Inf made by fc1 (aten.addmm in Linear)"
    # the bad row is +-3e38 (finite), fc1's output holds Infs: the ranges say both
    assert (
        lines[lines.index("inputs:") + 1]
        == "  args: float32 8x8, finite range [-3e+38, 3e+38], 0 NaN, 0 Inf"
    )
    out = lines[lines.index("output:") + 1]
    assert out.startswith("  output: float32 8x16, finite range [") and not out.endswith(" 0 Inf")


def test_stateful_fault_is_not_reproduced_exit_1(tmp_path):
    _, path = capsule_of(TransientPoison(at=7), tmp_path)
    done = replay(path, "--runs", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        done.stdout.splitlines()[0]
        == "not reproduced in 4 runs on cpu: transient (suspect nondeterminism or hardware)"
    )


def test_producer_class_not_importable_exit_2_with_one_line(tmp_path):
    _, path = local_producer_capsule(tmp_path)
    done = replay(path)
    assert done.returncode == 2
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "could not load: the capsule holds only the state_dict of "
    )
    assert "local_producer_capsule.<locals>.LocalExp" in lines[0] and not done.stderr


def test_not_a_capsule_exit_2(tmp_path):
    missing = replay(str(tmp_path / "nothing.pt"))
    assert (missing.returncode, missing.stdout) == (
        2,
        f"could not load: no capsule at {tmp_path / 'nothing.pt'}\n",
    )
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    junk = replay(str(tmp_path / "junk.pt"))
    assert junk.returncode == 2 and len(junk.stdout.splitlines()) == 1


MYNET = """
import torch
from torch import nn


class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.exp(x * self.gain)


class MyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Exp()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.scale(x))
"""


def test_replay_run_from_the_model_codes_folder_imports_it(tmp_path, monkeypatch):
    """The producer's class lives in mynet.py next to where the person runs `hookprof replay`
    (no PYTHONPATH): it is importable there, as under `python -m` (exit 2 before)."""
    import torch

    import hookprof

    (tmp_path / "mynet.py").write_text(MYNET)
    monkeypatch.syspath_prepend(str(tmp_path))
    from mynet import MyNet

    torch.manual_seed(0)
    model = MyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = hookprof.Config(port=0, summary_at_exit=False, capsule_dir=str(tmp_path / "caps"))
    with hookprof.attach(model, config=config) as prof:
        for step in range(1, 5):
            x = torch.randn(4, 8) * 0.1
            if step == 3:
                x[0] = 100.0  # exp(100) overflows float32: the producer is mynet.Exp
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        prof.flush()
        path = prof.snapshot().first_nonfinite.capsule
    assert path is not None
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("HOOKPROF_") and k != "PYTHONPATH"
    }
    env["PYTHONPATH"] = str(ROOT)  # hookprof itself, not the model's folder
    # the installed console script (not `python -m`, which puts the folder on the path itself)
    script = os.path.join(os.path.dirname(sys.executable), "hookprof")
    if not os.path.exists(script):  # run from a checkout on PYTHONPATH (the GPU image): no script
        reason = (
            f"no console script {script}: hookprof is not pip-installed here (pip install -e .)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; .ci/run installs it in CI")
        pytest.skip(reason)
    done = subprocess.run(
        [script, "replay", path],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("reproduced: NaN/Inf made by scale")
