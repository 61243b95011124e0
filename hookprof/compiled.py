"""Working under torch.compile: spotting a compiled model or a traced hook, saying what is off.

Per-layer hooks cannot time anything inside a compiled graph, and a hook that calls
`time.perf_counter_ns` or reads a tensor breaks the graph. So every module hook returns at
once while Dynamo traces it (`torch.compiler.is_compiling()` is a constant there: the hook
traces to nothing, no graph break), and the root module's pre-hook leaves one mark that
Dynamo replays after every compiled call: `CompileProbe.seen`. At the next step boundary the
profiler sees it and stops installing per-layer hooks for good (their installation would
change Dynamo's guards and force recompiles). What keeps working: step count and duration,
gradient norms and non-finite gradient checks (taken in the optimizer hooks, which run
eagerly), the model-output check (traced into the graph: nonfinite/traced.py) and the eager
replay that names a forward NaN's layer, the loss passed to `Profiler.step(loss)`, and
system metrics. Under regional compilation (blocks compiled one by one) the layers inside
the compiled blocks get no per-layer hooks; each block is timed as one call from outside its
graph (`compiled_regions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from hookprof.layers import ROOT_NAME

log = logging.getLogger("hookprof")

# called first thing in every hook: the function itself, not a wrapper around it (one
# Python call less per hook, and Dynamo recognises it as the constant True while tracing)
is_compiling: Callable[[], bool] = (
    getattr(getattr(torch, "compiler", None), "is_compiling", None)
    or torch._dynamo.is_compiling  # torch < 2.3
)


_compiler: Any = getattr(torch, "compiler", None)
_HAS_EXPORT_FLAG = hasattr(_compiler, "_is_exporting_flag")
if _HAS_EXPORT_FLAG:

    def is_exporting() -> bool:
        """torch.export is tracing the model. Not torch.compiler.is_exporting(): up to torch
        2.12 Dynamo folds that call to the constant True inside every trace, torch.compile's
        too (fixed in 2.13), so a compiled root hook took itself for an export and skipped
        the output check (found on the first GPU run, torch 2.11: every compiled forward NaN
        was missed). The flag it returns is a module global, which Dynamo reads as a guarded
        constant in every version."""
        return bool(_compiler._is_exporting_flag)
else:  # torch < 2.3: no flag; the function where there is one
    is_exporting = getattr(_compiler, "is_exporting", lambda: False)
# torch.jit.is_tracing() without its Python frame (what it returns outside TorchScript)
_is_tracing = torch._C._is_tracing
# torch.func (vmap, grad, jacrev, functional_call under them): no public predicate in torch
# 2.13; torch.autograd.Function asks torch this same private question for the same reason
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def transformed() -> bool:
    """True while the model runs under a transform that is not training: torch.jit.trace
    (SummaryWriter.add_graph), a torch.func transform (per-sample gradients with
    vmap(grad(...))), torch.export. hookprof steps aside there: what its hooks do (a clock,
    device reductions, a host read of a flag) would be traced into the graph, fails on
    BatchedTensors, and the call is no training step. ~0.1 us, in the root's hooks."""
    # the export flag read here, not through is_exporting(): one Python call less per hook
    return (
        _is_tracing()
        or _functorch_active()
        or (_compiler._is_exporting_flag if _HAS_EXPORT_FLAG else is_exporting())
    )


class Region(NamedTuple):
    """A module compiled on its own below the root (regional compilation): its calls run
    inside a graph, so its layers cannot be timed, but the call itself starts and ends
    outside it and is timed as one row."""

    row: int  # the layer table's layer index, or len(layers) + k for its k-th container
    target: nn.Module  # the object whose compiled call is wrapped
    attribute: (
        str  # "_compiled_call_impl" (module.compile()) or "forward" (torch.compile's wrapper)
    )


def compiled_regions(table: Any) -> tuple[list[Region], set[int]]:
    """(the outermost compiled regions below the root, the layers that run inside any
    region). A region: a module compiled with module.compile() (its `_compiled_call_impl`),
    or one whose parent holds a torch.compile wrapper in its place (the wrapper's
    `forward`). The root compiled: no region (the step's time is its time), every layer
    inside. On sampled steps only: one pass over the modules' children, one over each
    layer's name prefixes."""
    rows = table.row_of  # id(module) -> (row, name)
    found: dict[str, Region] = {}
    for row, name, module in table.named_rows():
        if module is None:
            continue
        if getattr(module, "_compiled_call_impl", None) is not None:
            found[name] = Region(row, module, "_compiled_call_impl")
        for child in module._modules.values():
            if child is not None and type(child).__name__ == "OptimizedModule":
                # the wrapper's own row (compiled before attach), else its module's (after)
                known = rows.get(id(child)) or rows.get(id(getattr(child, "_orig_mod", None)))
                if known is not None:
                    found[known[1]] = Region(known[0], child, "forward")
    if ROOT_NAME in found:
        return [], {layer.index for layer in table.layers}
    inside = set()
    if found:
        for layer in table.layers:
            name = layer.name
            while name:  # the layer's own name, then each enclosing module's
                if name in found:
                    inside.add(layer.index)
                    break
                name = name.rpartition(".")[0]
    outermost = []
    for name, region in found.items():
        outer = name.rpartition(".")[0]
        while outer and outer not in found:
            outer = outer.rpartition(".")[0]
        if not outer:
            outermost.append(region)
    return sorted(outermost, key=lambda r: r.row), inside


class CompileProbe:
    """Set by the root forward pre-hook when it runs inside a compiled graph."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module to instrument, whether it was compiled before attach)."""
    orig = getattr(model, "_orig_mod", None)  # torch.compile(model) returns an OptimizedModule
    if isinstance(orig, nn.Module) and type(model).__name__ == "OptimizedModule":
        return orig, True
    if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile()
        return model, True
    return model, False


COMPILED_NOTE = (
    "per-layer forward/backward times are off inside the compiled graph (a hook can time nothing "
    "there, and installing one forces a recompile), and per-layer activation statistics come from "
    "an eager re-run of sampled steps' forward; the model-output "
    "NaN/Inf check runs inside the graph, and a forward NaN/Inf is localised by replaying that "
    "step's forward eagerly; step count and duration, gradient norms, non-finite gradient and "
    "loss checks and system metrics continue. For per-layer times, compile block by block "
    "(the layers between the blocks are timed) or profile an eager run."
)


def explain_attached_after_compile(notices: Any) -> None:
    notices.say("compiled", f"the model was compiled before attach(): {COMPILED_NOTE}")


def explain_compiled_forward(notices: Any) -> None:
    notices.say(
        "compiled", f"the model's forward runs under torch.compile: {COMPILED_NOTE}", logging.INFO
    )
