"""What happens on the device between the last backward of a step and its update.

Two things, both decided where the update is about to run (the optimizer's step pre-hook or
the end of its closure) and neither waiting for the device:

- **A GradScaler's decision on the device.** With a fused optimizer (`fused=True` Adam,
  AdamW, SGD, Adagrad: `_step_supports_amp_scaling`), `GradScaler.step` always calls
  `optimizer.step()` and lets the kernel skip through `optimizer.found_inf`; the gradients
  it reads are still scaled (`optimizer.grad_scale`). `ScalerView` reads both attributes:
  gradient norms are divided by the scale, the backward check ignores a step the scaler
  skips, and `DeviceSkips` counts the skips (and runs of them) in device counters drained
  with the others. A non-fused optimizer's skip is a host decision (`gradscaler.py`).

- **Holding back a non-finite update** (`on_nonfinite="skip"` or `"raise"`): when this
  step's model output or gradients hold a NaN/Inf, its update must not reach the weights or
  the optimizer state, so that training can go on (or stop) with intact weights and the
  replay that names the producer runs on finite ones. A flag already on the host (a CPU
  model) hides the gradients from the optimizer for this one step (`.grad = None`: every
  torch.optim optimizer skips such a parameter, state included) and puts them back after.
  A flag still on the device is given to a fused optimizer's kernel through `found_inf`,
  which skips exactly and on the device. Any other optimizer on an accelerator cannot be
  held back without waiting for the device: `Config.nonfinite_sync=True` waits for the one
  flag per step (opt-in; see docs/nonfinite.md for its cost); otherwise this is said once.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch

from hookprof.device import transfer
from hookprof.nonfinite.detector import nonfinite_mask
from hookprof.nonfinite.output import any_flag


# found_inf is read by these optimizers' fused kernels (torch.optim, torch >= 2.4)
def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and any(
        g.get("fused") for g in optimizer.param_groups
    )


def by_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Is GradScaler's fused path inside this optimizer's step (it sets grad_scale and
    found_inf on the optimizer for the step, then deletes both)?"""
    return hasattr(optimizer, "grad_scale")


class ScalerView:
    """A GradScaler's state as a fused optimizer sees it during `GradScaler.step`: the
    scale its gradients still carry, and the device flag of a skip. Both None otherwise."""

    __slots__ = ("scale", "found_inf", "_skipped")

    def __init__(self, optimizer: torch.optim.Optimizer):
        # per device, the 0-d bool "the scaler skips this step" (`mask`: made once per step,
        # for both readings of the gradients)
        self._skipped: dict[torch.device, torch.Tensor] = {}
        self.scale = getattr(optimizer, "grad_scale", None)  # None after unscale_()
        # GradScaler sets grad_scale (to None after unscale_()) beside its found_inf; a
        # found_inf alone is the guard of another profiler sharing this optimizer, not a skip
        self.found_inf = getattr(optimizer, "found_inf", None) if by_scaler(optimizer) else None

    @property
    def active(self) -> bool:
        return self.found_inf is not None

    def unscale(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-layer squared norms of scaled gradients -> of the gradients the update uses."""
        if self.scale is None:
            return parts
        return [p / self.scale.to(p.device, torch.float64).reshape(()).square() for p in parts]

    def mask(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The squares the backward check counts: none on a step the scaler skips (an
        overflow it handles is a skipped step, not an incident)."""
        found_inf = self.found_inf
        if found_inf is None:
            return parts
        out = []
        for p in parts:
            skipped = self._skipped.get(p.device)
            if skipped is None:
                skipped = self._skipped[p.device] = found_inf.to(p.device).reshape(()) > 0
            out.append(p.masked_fill(skipped, 0.0))
        return out


class DeviceSkips:
    """Steps a GradScaler skipped on one device, counted there: [skipped, persistent (skips
    beyond max_skipped_steps in a row), the current run]. In-place ops, no host copy."""

    def __init__(self, device: torch.device, max_in_a_row: int):
        self.flat = torch.zeros(3, dtype=torch.int64, device=device)
        self._max = max_in_a_row

    def add(self, found_inf: torch.Tensor) -> None:
        skipped = (found_inf.reshape(()) > 0).to(torch.int64)
        self.flat[0].add_(skipped)
        self.flat[2].add_(1).mul_(skipped)  # the run goes on, or starts again at 0
        self.flat[1].add_((self.flat[2] > self._max).to(torch.int64))


class SkipCounters:
    """The DeviceSkips of each device a scaler's flag lives on."""

    def __init__(self, max_in_a_row: int):
        self._max = max_in_a_row
        self.by_device: dict[torch.device, DeviceSkips] = {}

    def add(self, found_inf: torch.Tensor) -> None:
        c = self.by_device.get(found_inf.device)
        if c is None:
            c = self.by_device[found_inf.device] = DeviceSkips(found_inf.device, self._max)
        c.add(found_inf)

    def blocks(self) -> list[torch.Tensor]:
        return [c.flat for c in self.by_device.values()]


def fold_skips(parts: list[list[float]]) -> tuple[int, int]:
    """Host side: (skipped, persistent) over the drained blocks of all devices."""
    return (sum(int(p[0]) for p in parts), sum(int(p[1]) for p in parts))


def delegates_update(optimizer: torch.optim.Optimizer) -> bool:
    """A closure optimizer that hands its update to an inner optimizer (davda54's SAM keeps
    one in `base_optimizer`): its own code between the closure and the inner step (undoing
    the climb, for SAM) still reads .grad, so the guard acts at the inner step's pre-hook,
    where the update reads them, not when the closure returns."""
    return any(isinstance(v, torch.optim.Optimizer) for v in vars(optimizer).values())


class DelegationCache:
    """`delegates_update` per optimizer, asked on every closure step, computed once (it walks
    the optimizer's attributes). Held weakly: an optimizer the loop dropped, or one of a
    detached profiler, is not kept alive here. Recomputed when the optimizer gains or loses
    an attribute: an inner optimizer is set as an attribute, in __init__ (davda54's SAM) or
    lazily on a first step, which changes the count; the count is O(1) to read. Not seen: an
    existing attribute rebound from a non-optimizer to an optimizer (or back) with no other
    attribute added, which no closure optimizer we know of does."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, optimizer: torch.optim.Optimizer) -> bool:
        n_attrs = len(vars(optimizer))
        cached = self._known.get(optimizer)
        if cached is not None and cached[0] == n_attrs:
            return cached[1]
        delegates = delegates_update(optimizer)
        self._known[optimizer] = (n_attrs, delegates)
        return delegates


# the code of torch's Optimizer.step wrapper (profile_hook_step): it runs the step pre-hooks,
# the step and the post-hooks; every patched optimizer's step runs in a frame of this code
_STEP_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


class UnwindWatch:
    """Runs `put_back` when the optimizer step in progress on this thread leaves its frame,
    however it leaves: the exit a post-hook never sees is a step that raises.

    Why a profile function, and only for a held step: torch runs the post-hooks only after a
    step that returned, and nothing of ours is on the stack when the step raises. Wrapping
    the user's optimizer (an instance `step`) would see it, but torch's LR schedulers patch
    that same attribute, a pickled or copied optimizer would carry the wrapper, and every
    step would pay for it. `sys.setprofile` set from the step pre-hook, for the one step
    whose gradients were hidden (a non-finite step: rare), sees the return of the step's
    wrapper frame, by exception too, and takes itself off there. The rest of such a step
    (which updates nothing) pays a Python call per function call. Never over someone
    else's profile function (cProfile, torch.profiler's Python stacks): then `watch` says
    False and the gradients of a step that raises stay hidden (dropped at the next update)."""

    def __init__(self, put_back: Any):
        self._put_back = put_back
        self._frame: Any = None  # the step wrapper's frame being watched

    def watch(self) -> bool:
        if self._frame is not None:
            return True
        if sys.getprofile() is not None:
            return False
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code is not _STEP_WRAPPER_CODE:
            frame = frame.f_back
        if frame is None:  # not inside an optimizer step (a direct call): nothing to watch
            return True
        self._frame = frame
        sys.setprofile(self._on_event)
        return True

    def _on_event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame is self._frame:  # returned or raised
            self._frame = None
            sys.setprofile(None)
            self._put_back()


class UpdateGuard:
    """Holds back this step's update when its checks found a NaN/Inf (policies "skip" and
    "raise"). `begin_update` runs at an optimizer's step pre-hook, `before_update` where the
    gradients are final (that pre-hook, or each return of a closure the step calls),
    `after_update` at the optimizer's post-hook puts back what it took, and `end_step` at
    the step's end counts the step once.

    A step is held back as a whole: once one of its checks failed, every later evaluation
    of a closure (LBFGS's line search, a sharpness-aware optimizer's second pass) and every
    later optimizer of the same step is held back too, so no part of a bad step's update
    lands. What an evaluation took is put back before the closure runs again (so that it
    finds the gradients it left) and at the optimizer's post-hook."""

    def __init__(self, wait_for_device: bool, say_once: Any):
        self._wait = wait_for_device
        self._say = say_once
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its grad)
        # (optimizer, our found_inf, the one it replaced: GradScaler's, or None)
        self._set_found: tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor | None] | None = (
            None
        )
        self._step_held = False  # this step's update is held back on the host's word
        self._step_bad: torch.Tensor | None = None  # device flag over this step's checks
        # the step that ended last: held on the host's word, its device flag (for a later
        # optimizer of that step, `hold_again`), and whether such an update is held now
        self._ended_held = False
        self._ended_bad: torch.Tensor | None = None
        self._later_held = False
        self.held_back = 0  # steps held back on the host's word (device ones: a SkipCounters)
        # this step had an update that could not be held back (a non-fused optimizer on a
        # device, no nonfinite_sync): if the step was non-finite, the weights took it
        self.unguarded = False
        self.delegates = DelegationCache()  # judged at the inner optimizer's pre-hook
        # puts the hidden gradients back when the step raises (no post-hook runs then)
        self._unwind = UnwindWatch(self._put_back_grads)

    @property
    def holding(self) -> bool:
        """An update of this step (or a later optimizer's of the step that ended) is held back."""
        return self._step_held or self._later_held

    def begin_update(self) -> None:
        """An optimizer step begins: an update that raised never reached after_update (its
        gradients were put back as it raised, see UnwindWatch, unless another profile function
        was set), so what it took is not put back onto a later step's parameters, nor its
        found_inf kept."""
        self._hidden.clear()
        self._take_back_found_inf()
        self._later_held = False

    def before_update(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        flags: list[bool | torch.Tensor],
    ) -> None:
        """`flags`: this step's checks so far (host bools, device 0-d bools)."""
        if self._step_held or any(f is True for f in flags):
            self._hide(params)
            return
        on_device = [f for f in flags if isinstance(f, torch.Tensor)]
        if not on_device:
            return
        bad = any_flag(on_device)  # the output's (combined once, by its owner) and the gradients'
        if self._step_bad is not None:  # an earlier evaluation or optimizer of this step
            bad = bad | self._step_bad.to(bad.device, torch.bool)
        if is_fused(optimizer):
            # kept as a float32 copy of the guard's own (the found_inf the kernel reads: no op
            # more): `bad` may be the detector's pending forward slot itself (a step's first
            # output check writes there), which a later forward of the step writes again
            found = bad.to(torch.float32)
            self._give_found_inf(optimizer, found)
            self._step_bad = found
            return
        if self._wait:
            if bool(transfer.read_now(bad)):  # the opt-in wait (Config.nonfinite_sync)
                self._hide(params)
            return
        self.unguarded = True
        self._say_unfused(optimizer)

    def hold_again(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """A later optimizer of the step that has just ended: a model trained by two
        optimizers without prof.step(), whose first one's post-hook ended the step (no
        forward since). Its update is held back as the step's was, so that no part of a bad
        step's update lands; it is no new step, and is not counted again."""
        if self._ended_held:
            self._hide_grads(params)
            self._later_held = bool(self._hidden)
            return
        bad = self._ended_bad  # a device flag: the step's fused update was judged on the device
        if bad is None:
            return
        if is_fused(optimizer):
            self._give_found_inf(optimizer, bad)
        elif self._wait:
            if bool(transfer.read_now(bad)):  # the opt-in wait (Config.nonfinite_sync)
                self._hide_grads(params)
                self._later_held = bool(self._hidden)
        else:
            self._say_unfused(optimizer)

    def _give_found_inf(self, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
        found = bad.to(torch.float32)  # (itself when float32 already: no op)
        earlier = getattr(optimizer, "found_inf", None)
        if earlier is not None:  # GradScaler's, or another profiler's guard: skip on either
            found = torch.maximum(earlier.to(found.device).reshape(found.shape), found)
        optimizer.found_inf = found  # type: ignore[attr-defined]  # read by the fused kernel; removed after the step
        # GradScaler.step deletes its own found_inf after the step: it gets it back. Another
        # guard's is not handed back (it would outlive its step): that guard finds ours
        # in its place and leaves it, and ours is removed
        self._set_found = (optimizer, found, earlier if by_scaler(optimizer) else None)

    def _say_unfused(self, optimizer: torch.optim.Optimizer) -> None:
        self._say(
            "non-fused update",
            (
                f"on_nonfinite holds back a non-finite update on the device only for fused "
                f"optimizers (fused=True Adam, AdamW, SGD, Adagrad); {type(optimizer).__name__} "
                "is not fused, so a NaN/Inf step's update reaches the weights unless "
                "nonfinite_sync=True (waits for one value per step)"
            ),
        )

    def _hide(self, params: Sequence[torch.Tensor]) -> None:
        self._hide_grads(params)
        self._step_held = True

    def _hide_grads(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            if p.grad is not None:
                self._hidden.append((p, p.grad))
                p.grad = None
        if self._hidden and not self._unwind.watch():
            self._say(
                "held step raises",
                (
                    "another profile function is set (sys.setprofile: cProfile, a Python-stack "
                    "profiler): if an optimizer step held back by on_nonfinite raises, the "
                    "gradients hookprof hid from it are not put back"
                ),
            )

    def after_update(self) -> None:
        """Put back the gradients (the loop may read them after the step) and take our
        found_inf off the optimizer, unless someone replaced it since. Also called before a
        closure runs again, so that the closure finds the gradients it left."""
        self._put_back_grads()
        self._take_back_found_inf()
        self._later_held = False

    def _put_back_grads(self) -> None:
        for p, grad in self._hidden:
            if p.grad is None:
                p.grad = grad
        self._hidden.clear()

    def end_step(self) -> torch.Tensor | None:
        """The step ended: count it once if held back on the host; returns the device flag
        handed to fused kernels during it (for counting), else None."""
        if self._step_held:
            self.held_back += 1
        self._ended_held, self._ended_bad = self._step_held, self._step_bad
        bad, self._step_bad, self._step_held = self._step_bad, None, False
        self.unguarded = False
        return bad

    def _take_back_found_inf(self) -> None:
        if self._set_found is not None:
            optimizer, found, replaced = self._set_found
            self._set_found = None
            if getattr(optimizer, "found_inf", None) is found:
                if replaced is None:
                    del optimizer.found_inf  # type: ignore[attr-defined]
                else:  # GradScaler.step deletes its own after the step: leave it one to delete
                    optimizer.found_inf = replaced  # type: ignore[attr-defined]


def host_flags_of_squares(parts: list[torch.Tensor]) -> list[bool | torch.Tensor]:
    """One flag per device part of per-layer squared norms: a host bool where reading it
    waits for nothing, else a device 0-d bool."""
    out: list[bool | torch.Tensor] = []
    for p in parts:
        bad = nonfinite_mask(
            p.sum(dtype=torch.float64)
        )  # float32 layer values: no overflow of the sum
        out.append(bool(bad) if transfer.on_host(bad) else bad)
    return out
