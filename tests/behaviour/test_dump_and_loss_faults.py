"""A fault in one piece costs that piece only (DESIGN.md invariant 3, issue 29 item 5):
a NaN report that cannot be written (a dump_dir under a file, a full disk) and a loss that is
not a real scalar (`prof.step((loss, outputs))`) leave step counting, gradient reading and
NaN detection on. And two models of one process dumping at one step write two files."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import hookprof
from support.inject import StepInjector
from support.models import DeepNet, loss_of, seeded
from support.paths import ROOT, TESTS, worker
from support.settings import EVERY_STEP, RARELY
from workers.file_fault_worker import nan_gradients_from

STEPS, BAD_FROM = 100, 10  # a backward NaN at every step from 10 on: 91 bad steps
BAD_STEPS = STEPS - BAD_FROM + 1


def test_a_dump_dir_under_a_file_costs_the_report_only(tmp_path, caplog):
    """Before: the failed dump switched the NaN checks off (2 backward NaN steps counted of
    91), and no log line said the dump failed or where."""
    (tmp_path / "a-file").write_text("not a directory")
    dump_dir = tmp_path / "a-file" / "dumps"
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        prof = nan_gradients_from(BAD_FROM, STEPS, on_nonfinite="dump", dump_dir=str(dump_dir))
    snap = prof.snapshot()
    prof.detach()
    assert prof.steps == STEPS
    assert snap.nonfinite_steps == {"forward": 0, "backward": BAD_STEPS, "loss": 0}
    assert snap.first_nonfinite is not None and snap.first_nonfinite.step == BAD_FROM
    assert snap.internal_errors == 3  # tried at the first three new non-finite steps, each counted
    path = os.path.join(
        str(dump_dir), f"hookprof-nonfinite-{prof.name}-rank0-pid{os.getpid()}-step{BAD_FROM}.json"
    )
    said = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(said) == 1 and path in said[0] and "Not a directory" in said[0], said
    assert f"at step {BAD_FROM} on rank 0" in said[0]  # the incident itself is still said
    faults = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(faults) == 1 and "nonfinite dump" in faults[0] and path in faults[0], faults
    assert not any("per-layer instrumentation is now off" in m for m in faults)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_full_disk_costs_the_report_only_and_leaves_no_temporary_file(tmp_path):
    """RLIMIT_FSIZE of 1 KiB in the training process (the report is larger): the write fails
    with EFBIG as on a full disk. Before: a 1 KiB invalid `.json.tmp` was left and the NaN
    checks went off."""
    dump_dir = tmp_path / "dumps"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            worker("file_fault_worker.py"),
            "train",
            str(dump_dir),
            "--fsize",
            "1024",
            "--steps",
            str(STEPS),
            "--bad-from",
            str(BAD_FROM),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout, done.stderr[-3000:])
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["error"] is None and out["steps"] == STEPS
    assert out["nonfinite_steps"] == {"forward": 0, "backward": BAD_STEPS, "loss": 0}
    assert out["internal_errors"] == 3
    assert os.listdir(dump_dir) == []  # no report, whole or in part, and no temporary file
    assert "could not be written" in done.stderr and "File too large" in done.stderr


def test_two_models_of_one_process_dump_the_same_step_to_two_files(tmp_path):
    """Before: both wrote hookprof-nonfinite-rank0-step3.json, the second over the first."""
    models = [seeded(DeepNet), seeded(DeepNet)]
    injectors = [StepInjector(m.blocks[1].fc, {3}) for m in models]
    profs = [
        hookprof.attach(m, **RARELY, serve=False, on_nonfinite="dump", dump_dir=str(tmp_path))
        for m in models
    ]
    g = torch.Generator().manual_seed(0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(1, 7):
        batch = models[0].batch(g)
        for model, injector, opt, prof in zip(models, injectors, opts, profs):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            prof.step(loss)
    for prof in profs:
        prof.detach()
    names = sorted(f"hookprof-nonfinite-{p.name}-rank0-pid{os.getpid()}-step3.json" for p in profs)
    assert len(set(names)) == 2 and sorted(os.listdir(tmp_path)) == names
    for prof in profs:
        report = json.loads(
            (
                tmp_path / f"hookprof-nonfinite-{prof.name}-rank0-pid{os.getpid()}-step3.json"
            ).read_text()
        )
        assert report["model"] == prof.name and report["incident"]["layer"] == "blocks.1.fc"


LOSSES = {
    "tuple": (lambda loss, out: (loss, out), "a tuple"),
    "dict": (lambda loss, out: {"loss": loss, "logits": out}, "a dict"),
    "list": (lambda loss, out: [loss], "a list"),
    "complex tensor": (
        lambda loss, out: loss.detach() * (1 + 1j),
        "a tensor of shape () and dtype torch.complex64",
    ),
    "many values": (
        lambda loss, out: (out.detach() - 1).pow(2).flatten(),
        "a tensor of shape (16,) and dtype torch.float32",
    ),
}


@pytest.mark.parametrize("kind", list(LOSSES))
def test_a_loss_that_is_not_a_real_scalar_is_said_once_and_steps_go_on(kind, caplog):
    """Before: 1 of 50 steps counted, 50 internal errors, the per-layer checks off."""
    given, words = LOSSES[kind]
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[2].fc, {40})
    prof = hookprof.attach(model, **EVERY_STEP, serve=False)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="hookprof"):
        for step in range(1, 51):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            inputs, target = model.batch(g)
            out = model(inputs)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            opt.step()
            prof.step(given(loss, out))
        prof.flush()
    snap = prof.snapshot()
    prof.detach()
    assert prof.steps == 50 and snap.step == 50
    assert snap.internal_errors == 0
    assert snap.sampled_steps == 50  # the per-layer checks stayed on
    assert snap.loss is None  # not exported
    said = [r.getMessage() for r in caplog.records if "not a real scalar" in r.getMessage()]
    assert len(said) == 1 and f"was given {words}," in said[0], said
    assert sum("not a real scalar" in n for n in snap.notices) == 1
    event = snap.first_nonfinite  # NaN detection went on, per layer
    assert event is not None and (event.layer, event.phase, event.step) == (
        "blocks.2.fc",
        "forward",
        40,
    )


def test_a_real_scalar_loss_of_any_kind_is_still_exported():
    """What stays a loss: a one-element tensor of any shape, a Python or numpy number (a 0-d array)."""
    import numpy as np

    for given, value in (
        (torch.tensor([[2.5]]), 2.5),
        (3, 3.0),
        (np.float32(1.5), 1.5),
        (np.array(0.25), 0.25),
    ):
        model = seeded(DeepNet)
        prof = hookprof.attach(model, **EVERY_STEP, serve=False)
        loss_of(model, model.batch(torch.Generator().manual_seed(0))).backward()
        prof.step(given)
        prof.flush()
        snap = prof.snapshot()
        prof.detach()
        assert (snap.step, snap.loss, snap.internal_errors) == (1, value, 0), given
        assert not any("not a real scalar" in n for n in snap.notices)
