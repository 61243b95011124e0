"""`hookprof replay` of a replay's capsule (check_capsule.py): the third answer.

(The scheduled replay check's, which compares every layer's output, or the spike replay's,
which compares the model's output: the same form.)

On the check step, one device ran the step's forward twice (the step's own, then the in-place
replay) and the two differed. This runs it a third time, in this process, from the capsule:
the step's weights, inputs, RNG (torch's, Python's, NumPy's) and the modules' state as the
forward began, under no_grad and the step's autocast, summing each layer's output bits as
the check did (tensors.output_checksum, in call order), `runs` times, each from a fresh copy of the
model (a forward changes BatchNorm's statistics). Then:

- the same kind of device as the capsule's, and every run alike:
  - every output the step's own bits: **reproduced elsewhere** (exit 0). The step computed
    right, and the in-place replay was the odd run: the machine during the replay;
  - not the step's own, but the in-place replay's bits: **not reproduced** (exit 1). Two runs
    of two processes agree against the step's: the step's forward computed wrongly, at the
    first layer named (the machine at that step, not the data);
  - neither (exit 1): each difference named; nondeterminism is the suspect;
- a spike its in-place replay reproduced (the spike replay's capsule of its batch: both runs
  on the step's device alike): every run here the step's bits, **reproduced** (exit 0, the
  data); otherwise **not reproduced here** (exit 1), the first layer that differs named;
- the runs here differ from one another: this device is not bit-reproducible for this model
  (nondeterministic kernels): no verdict (exit 3);
- another kind of device (a CUDA capsule on the CPU): other kernels, whose bits are not
  expected to match: no verdict (exit 3), the first layer that differs said all the same.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hookprof.nonfinite.check_capsule import backends, shown
from hookprof.nonfinite.reproduce import (
    NOT_REPRODUCED,
    REPRODUCED,
    CannotLoad,
    _autocast,
    _loaded,
    _set_rng,
    _to,
    load_module,
)
from hookprof.tensors import bits_sum, iter_tensors, output_checksum, summable

NO_VERDICT = 3  # exit status: the bits cannot be compared here (see the module's docstring)


def _sums_of_run(model: nn.Module, capsule: dict[str, Any], device: str) -> list[tuple[str, int]]:
    """One run of the step's forward from the capsule on a fresh copy of `model`: (layer,
    output bit sum) of each layer output, in call order, as the check summed them."""
    forward, view = capsule["forward"], capsule["view"]
    # (capsules written before output_checksum hold bits_sum's int64 sums)
    checksum = output_checksum if capsule["check"].get("checksum") else bits_sum
    fresh = copy.deepcopy(model)
    args, kwargs = _loaded(forward["inputs"])
    args, kwargs = _to(args, device), _to(kwargs or {}, device)
    seen: list[tuple[str, int]] = []

    def summed(name: str, forward_of: Callable[..., Any]) -> Callable[..., Any]:
        # the layer's own forward, wrapped as hookprof's hooks wrap it (step/hooks.py): a call
        # through `layer.forward(x)` is summed too, which a forward hook would not see
        def forward_and_sum(*args: Any, **kwargs: Any) -> Any:
            output = forward_of(*args, **kwargs)
            for t in (output,) if isinstance(output, torch.Tensor) else iter_tensors(output):
                if summable(t):
                    seen.append((name, int(checksum(t))))
            return output

        return forward_and_sum

    with _backends(view.get("backends") or {}):
        for name in dict.fromkeys(capsule["check"]["layers"]):
            try:
                layer = fresh.get_submodule(name)
            except AttributeError:
                raise CannotLoad(f"the capsule's model has no layer {name!r}") from None
            layer.forward = summed(name, layer.forward)
        entry = forward.get("entry")
        target = fresh.get_submodule(entry) if entry else fresh
        _set_rng(forward.get("cpu_rng"), forward.get("cuda_rng"), device)
        random.setstate(_loaded(forward["python_rng"]))
        if forward.get("numpy_rng") is not None:
            import numpy

            numpy.random.set_state(_loaded(forward["numpy_rng"]))
        with torch.no_grad(), _autocast(view.get("modes"), device):
            target(*args, **kwargs)
    return seen


@contextlib.contextmanager
def _backends(settings: dict[str, Any]) -> Iterator[None]:
    """The kernel choices the step ran with (check_capsule.backends), put back afterwards."""
    before = backends()

    def apply(values: dict[str, Any]) -> None:
        if "float32_matmul_precision" in values:
            torch.set_float32_matmul_precision(values["float32_matmul_precision"])
        if "cuda_matmul_allow_tf32" in values:
            torch.backends.cuda.matmul.allow_tf32 = values["cuda_matmul_allow_tf32"]
        if "cudnn_allow_tf32" in values:
            torch.backends.cudnn.allow_tf32 = values["cudnn_allow_tf32"]
        if "cudnn_deterministic" in values:
            torch.backends.cudnn.deterministic = values["cudnn_deterministic"]
        if "cudnn_benchmark" in values:
            torch.backends.cudnn.benchmark = values["cudnn_benchmark"]
        if "deterministic_algorithms" in values:
            torch.use_deterministic_algorithms(values["deterministic_algorithms"])

    apply(settings)
    try:
        yield
    finally:
        apply(before)


def _first_difference(
    names: list[str], expected: list[int], got: list[tuple[str, int]]
) -> int | None:
    """The first position where `got` differs from (names, expected), or None."""
    for k, (name, value) in enumerate(zip(names, expected)):
        if k >= len(got) or got[k] != (name, value):
            return k
    return None


def replay_check_capsule(
    capsule: dict[str, Any], device: str, runs: int, say: Callable[[str], None]
) -> int:
    """The capsule of a replay check's mismatch, run here (see the module's docstring)."""
    view, check = capsule["view"], capsule["check"]
    if "model" not in capsule:
        raise CannotLoad("the capsule holds no model")
    model = load_module(capsule["model"]).to(device)
    names, original, replayed = check["layers"], check["original"], check["replayed"]
    done = [_sums_of_run(model, capsule, device) for _ in range(runs)]
    here = done[0]
    step, at = view["step"], f"{view['host']}, {view['device']}"
    by_original = _first_difference(names, original, here)
    by_replay = _first_difference(names, replayed, here)

    def layer(k: int | None) -> str:
        return "none" if k is None else shown(names[k])

    if any(run != here for run in done[1:]):
        say(
            f"no verdict: {runs} runs on {device} gave different bits from one another "
            "(nondeterministic kernels for this model here), so none can stand for the step"
        )
        status = NO_VERDICT
    elif view.get("device_type", "cpu") != device:
        say(
            f"no verdict: the step ran on {view.get('device_type')}, this replay on {device}: "
            "other kernels, whose bits are not expected to match (first layer that differs "
            f"from the step's outputs here: {layer(by_original)}); replay it on a "
            f"{view.get('device_type')} device for a verdict"
        )
        status = NO_VERDICT
    elif check["first"] is None:  # (a spike its in-place replay reproduced: the data)
        if by_original is None:
            say(
                f"reproduced: {runs} runs on {device} give the step's own output bits at every "
                "layer, as its in-place replay did: the same batch on the same weights gives "
                "the spike (the data, not the machine: the batch is in this capsule)"
            )
            status = REPRODUCED
        else:
            say(
                f"not reproduced here: {runs} runs on {device} differ first at "
                f"{layer(by_original)}, where the step and its in-place replay agreed (suspect "
                "this machine, or a kernel that differs between these two setups)"
            )
            status = NOT_REPRODUCED
    elif by_original is None:
        say(
            f"reproduced elsewhere: {runs} runs on {device} give the step's own output bits at "
            f"every layer; the in-place replay, which differed first at "
            f"{layer(check['first'])}, was the odd run (suspect the machine during the replay)"
        )
        status = REPRODUCED
    elif by_replay is None:
        say(
            f"not reproduced: {runs} runs on {device} agree with the in-place replay and differ "
            f"from the step's own outputs first at {layer(by_original)}: the step's forward "
            f"computed {layer(by_original)} wrongly on {at} (the machine, not the data)"
        )
        status = NOT_REPRODUCED
    else:
        say(
            f"not reproduced: {runs} runs on {device} differ from the step's own outputs first "
            f"at {layer(by_original)} and from the in-place replay's first at "
            f"{layer(by_replay)} (suspect nondeterminism)"
        )
        status = NOT_REPRODUCED
    said = (
        "reproduced"
        if check["first"] is None
        else "not_reproduced, "
        + (f"layer {view['first_layer']}" if view["first_layer"] else "the model's output")
    )
    say(
        f"capsule of the {view.get('kind', 'replay check')} of step {step} on rank "
        f"{view['rank']} ({at}); hookprof said: {said}"
        + ("" if view.get("deterministic") else " (deterministic algorithms were off)")
    )
    if check.get("suspects"):
        say(
            "the batch's samples of largest loss (the capsule's inputs, by index along the "
            "first dimension): "
            + ", ".join(f"sample {s} (loss {v:.4g})" for s, v in check["suspects"])
            + f", of a total of {check['loss_total']:.4g}"
        )
    if view.get("hooks_left_out"):
        say(
            f"note: the model had {view['hooks_left_out']} hook(s) of the loop's own, which the "
            "capsule does not hold: one that changes a layer's output makes this replay differ "
            "from the step's for that reason alone"
        )
    if "pickle" not in capsule["model"]:
        say(
            "note: the model was rebuilt from its class and state_dict (it did not pickle: "
            f"{capsule['model'].get('not_pickled')}): state it keeps outside its buffers, and "
            "its submodules' train/eval modes, are not the step's"
        )
    return status
