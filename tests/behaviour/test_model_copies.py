"""Copies of an attached model carry nothing of hookprof (issue 29, items 2 and 3): EMA and
SWA copies, a shallow copy, `torch.save(model)` and `pickle` of the whole model or of one
layer, taken right after attach (the entry hooks are on the root's children) and between
two sampled steps (each layer's forward is wrapped). Each copy is compared with the same
copy of a twin model that was never attached: same attributes, same hooks."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import hookprof
from support.hooks_left import MODULE_HOOK_DICTS
from support.settings import EVERY_STEP


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def ema_update(ema: nn.Module, model: nn.Module, decay: float = 0.9) -> None:
    """What timm's ModelEmaV3 does each step: a deepcopy at the start, lerp after each update."""
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)


def what_hookprof_could_leave(model: nn.Module) -> list[tuple[str, list[str], list[int]]]:
    """Per module: its instance attribute names and the size of each of its hook dicts."""
    return [
        (name, sorted(vars(m)), [len(getattr(m, d, {})) for d in MODULE_HOOK_DICTS])
        for name, m in model.named_modules()
    ]


COPIES = {
    "deepcopy (EMA)": copy.deepcopy,
    "AveragedModel (SWA)": lambda m: AveragedModel(m).module,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": lambda m: torch.load(_saved(m), weights_only=False),
}


def _saved(m: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    return buffer


# the spike replay (Config.spike_replay) wraps every layer's forward from attach to detach,
# under the sampled steps' wrappers (step/output_sums.py): two of hookprof's on one forward
ARMED = {"plain": {}, "spike replay": {"spike_detection": True, "spike_replay": True}}


@pytest.mark.parametrize("armed", list(ARMED))
@pytest.mark.parametrize("when", ["after attach", "between sampled steps"])
@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_an_attached_model_is_the_copy_of_a_model_never_attached(how, when, armed):
    make_copy = COPIES[how]
    model, twin = make_model(), make_model()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin))
    with hookprof.attach(model, summary_at_exit=False, **EVERY_STEP, **ARMED[armed]):
        if when == "between sampled steps":
            train_steps(model, opt, 2, seed=1)
            train_steps(twin, twin_opt, 2, seed=1)
        expected = what_hookprof_could_leave(make_copy(twin))
        copied = make_copy(model)
        assert what_hookprof_could_leave(copied) == expected
        # a layer on its own too (the entry hooks and forward wrappers sit on layers)
        assert what_hookprof_could_leave(make_copy(model[0])) == what_hookprof_could_leave(
            make_copy(twin[0])
        )
    # detach took nothing from the copy, because it had nothing of hookprof's
    assert what_hookprof_could_leave(copied) == expected
    # ... and the original is as the twin again
    assert what_hookprof_could_leave(model) == what_hookprof_could_leave(twin)
    copied.eval()
    scripted = torch.jit.script(copied)
    x = torch.randn(4, 6)
    assert torch.equal(scripted(x), copied(x))


def make_parametrized_model() -> nn.Module:
    """weight_norm through torch's parametrizations: the class it injects copies its own
    __dict__ in a __deepcopy__ of its own (so does spectral_norm, orthogonal)."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(6, 16)), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("armed", list(ARMED))
@pytest.mark.parametrize("how", ["deepcopy (EMA)", "AveragedModel (SWA)"])
def test_a_copy_of_a_parametrized_model_is_the_copy_of_one_never_attached(how, armed):
    make_copy = COPIES[how]
    model, twin = make_parametrized_model(), make_parametrized_model()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin))
    with hookprof.attach(model, summary_at_exit=False, **EVERY_STEP, **ARMED[armed]):
        train_steps(model, opt, 2, seed=1)  # the layers' forwards are wrapped now
        train_steps(twin, twin_opt, 2, seed=1)
        copied = make_copy(model)
        assert what_hookprof_could_leave(copied) == what_hookprof_could_leave(make_copy(twin))
    assert what_hookprof_could_leave(model) == what_hookprof_could_leave(twin)
    x = torch.randn(4, 6)
    assert torch.equal(copied(x), make_copy(twin)(x))


def test_ema_and_swa_copies_train_bit_identically_and_script_while_attached():
    """A training run with an EMA and an SWA copy made at step 2, with and without hookprof:
    every parameter and buffer of model, EMA and SWA copy bit-identical after 6 steps, and the
    copies script while the original is still attached."""
    results = []
    for attached in (False, True):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        prof = hookprof.attach(model, summary_at_exit=False, **EVERY_STEP) if attached else None
        try:
            train_steps(model, opt, 2, seed=3)
            ema, swa = copy.deepcopy(model), AveragedModel(model)
            for k in range(4):
                train_steps(model, opt, 1, seed=10 + k)
                ema_update(ema, model)
                swa.update_parameters(model)
            ema.eval()
            torch.jit.script(ema)  # while the original is attached
            if prof is not None:
                prof.flush()
                assert prof.snapshot().step == 6 and prof.snapshot().internal_errors == 0
        finally:
            if prof is not None:
                prof.detach()
        results.append(
            [t.clone() for m in (model, ema, swa) for t in (*m.parameters(), *m.buffers())]
        )
    plain, profiled = results
    assert len(plain) == len(profiled)
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))


LOAD_WITHOUT_HOOKPROF = r"""
import sys
sys.modules["hookprof"] = None  # any reference to hookprof in the pickle fails to load
import torch
from torch import nn
model = torch.load(sys.argv[1], weights_only=False)
hooks = sum(len(getattr(m, d, {})) for m in model.modules() for d in %r)
attrs = sorted({k for m in model.modules() for k in vars(m) if k in ("forward", "__reduce_ex__")})
model.eval()
torch.manual_seed(0)
out = model(torch.randn(4, 6))
print(hooks, attrs, repr(out.sum().item()))
""" % (MODULE_HOOK_DICTS,)  # noqa: UP031 (a script with a repr in it: %r is the clearest)


def test_a_model_saved_while_attached_loads_where_hookprof_is_not_installed(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = str(tmp_path / "model.pt")
    with hookprof.attach(model, summary_at_exit=False, **EVERY_STEP):
        train_steps(model, opt, 2, seed=5)  # the layers' forwards are wrapped now
        torch.save(model, path)
        model.eval()
        torch.manual_seed(0)
        expected = model(torch.randn(4, 6)).sum().item()
    with open(path, "rb") as f:
        assert b"hookprof" not in f.read()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HOOKPROF, path],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    hooks, attrs, value = done.stdout.split(" ", 2)
    assert (hooks, attrs) == ("0", "[]")
    assert float(value) == expected  # the same weights and BatchNorm statistics
