"""The model-output check inside a compiled graph, and the inputs a replay needs from it.

Under torch.compile the root module's hooks are traced into the graph (Dynamo inlines them),
so the eager output check (a host read, a clock) cannot run there. What runs instead, traced:
one `isfinite(...).all()` per floating output tensor, written into two counters hookprof owns
on the model's device (`counts[0]`: the last forward's output was non-finite; `counts[1]`:
how many forwards of this step had one), and a reference to the forward's inputs kept as a
Python side effect (Dynamo replays the attribute store after each compiled call; the inputs
are the graph's own inputs, so nothing is copied). No graph break, no recompilation: the
counters are the same tensors every call, and the ops are plain tensor ops (checked against
torch._dynamo's counters in the tests, with aot_eager and inductor, fullgraph too).

At the step's update (or its end), eagerly, `take` turns the counters into the step's flags
(two small device ops: a `gt` and a `zero_`) for the same readers as the eager check:
OutputFlags (the detector, the update guard) and the forward replay, which then runs the
step's forward again eagerly (torch.compiler.set_stance("force_eager")) with the per-layer
checks on, and names the layer as on an eager model.

The RNG state for that replay is taken at the step's beginning (eagerly: `get_rng_state`
breaks a graph). Under `aot_eager` dropout then draws the same masks as the compiled forward
did (unless the loop draws random numbers between the step's start and its forward); under
`inductor`, which generates its own random numbers, it does not (docs/nonfinite.md).

Where the check runs: with `fullgraph=True` Dynamo inlines the root's hooks, and the check is
part of the model's graph; otherwise each hook is compiled as a frame of its own, and the
check is a small graph beside the model's (compiled once, like it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookprof.compiled import is_exporting
from hookprof.nonfinite.replay import RngState, rng_state
from hookprof.tensors import iter_tensors


def _static_address(counts: torch.Tensor) -> torch.Tensor:
    """The counters marked as torch._dynamo.mark_static_address(counts) marks a tensor (that
    attribute is all it sets; importing torch._dynamo at attach would cost ~1 s): their address
    never changes, so under CUDA graphs (mode="reduce-overhead") their in-place updates are
    those of a buffer, like BatchNorm's running statistics, instead of a mutated input for
    which inductor skips the graph (seen on the first GPU run: cudagraph_skips 1 with hookprof,
    0 without). tests/behaviour/test_compiled_nonfinite.py checks that torch's own machinery
    sees them as static inputs."""
    counts._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    return counts


class TracedOutputCheck:
    """Owns the two device counters of the compiled output check, the inputs of the step's
    last compiled forward and the RNG state at the step's start. `note_inputs` and
    `note_output` run traced (inside Dynamo); everything else eagerly."""

    def __init__(self, device: torch.device, say: Callable[[str, str], None] | None = None):
        # [last forward non-finite (0/1), non-finite forwards this step]
        self.counts = _static_address(torch.zeros(2, dtype=torch.int32, device=device))
        self._say = say
        self.inputs: tuple[Any, Any] | None = None  # (args, kwargs) of the last compiled forward
        self.called = False  # a compiled forward of the model ran since the last take()
        self.compiled = True  # until an eager forward says otherwise (then no RNG is kept)
        self.rng: RngState | None = None

    # ---- traced: plain tensor ops and attribute stores only ----

    def note_inputs(self, args: Any, kwargs: Any) -> None:
        if not is_exporting():
            self.inputs = (args, kwargs)

    def note_output(self, output: Any) -> None:
        if is_exporting():
            return  # torch.export traces the model once: no step of training
        counts = self.counts
        bad = None
        for t in iter_tensors(output):
            if t.is_floating_point() and t.device == counts.device:
                one = torch.logical_not(torch.isfinite(t.detach()).all())
                bad = one if bad is None else bad | one
        if bad is not None:
            bad = bad.to(torch.int32)
            counts[0].copy_(bad)
            counts[1].add_(bad)
        self.called = True

    # ---- eager ----

    def _moved(self, device: torch.device) -> None:
        """The model runs on another device than at attach (model.cuda() after attach): the
        counters follow it; the compiled graph picks them up at its next (one) recompile."""
        was = self.counts.device
        self.counts = _static_address(torch.zeros(2, dtype=torch.int32, device=device))
        if self._say is not None:
            self._say(
                "compiled check moved",
                f"the compiled model's inputs are on {device}, its parameters were on {was} at "
                f"attach(): its output NaN/Inf check moves to {device} (one recompile); the step "
                "it was found on went unchecked. Attach after moving the model to its device.",
            )

    def step_began(self) -> None:
        """Keep the RNG state for a replay of this step's compiled forward (a few us)."""
        if self.compiled:
            self.rng = rng_state()

    def eager_forward(self) -> None:
        """An eager training forward of the model ran: it is checked the eager way."""
        self.compiled = False

    def take(self) -> tuple[Any, Any, Any] | None:
        """After compiled forwards: (the last forward's flag, the step's flag, its inputs),
        flags as the eager check gives them (host bools on the CPU, 0-d device bools else),
        and the counters zeroed for the next step. None: no compiled forward since the last
        take."""
        if not self.called:
            return None
        self.called = False
        self.compiled = True
        inputs, self.inputs = self.inputs, None
        device = (
            next((t.device for t in iter_tensors(inputs)), None) if inputs is not None else None
        )
        if device is not None and device != self.counts.device:
            self._moved(device)
            return None  # this step's outputs were not on the counters' device: not checked
        flags = self.counts.gt(0)
        self.counts.zero_()
        if flags.device.type == "cpu":
            # a read of two CPU values, no device to wait for (an accelerator's flags stay
            # there, read later without waiting, like the eager check's)
            last, any_forward = flags.tolist()
            return last, any_forward, inputs
        return flags[0], flags[1], inputs
