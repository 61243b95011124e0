"""The model-output check of one step, with one owner.

Every training forward's output is checked (nonfinite.nonfinite_flags: a host bool for CPU
tensors, one 0-d device bool per accelerator). Three parts read the result: the forward
replay (was *this* forward's output non-finite? peeked at once, read when it arrives), the
update guard (was anything of this step non-finite, before its update?) and the detector
(count the step once, at its end). The flags are combined here, once, as they come, and
each reader takes what it needs, so no reader stacks them again: for the common step (one
forward, one device) the combining costs no op at all.
"""

from __future__ import annotations

import torch


def any_flag(flags: list[torch.Tensor]) -> torch.Tensor:
    """One 0-d device bool, true when any of `flags` (0-d bools) is: the flag itself when
    there is one, one `|` for two (a stack and an any would be three ops with the reshape),
    a stack beyond. Flags on other devices are brought to the first one's (a device copy,
    no wait for the host)."""
    first = flags[0]
    if len(flags) == 1:
        return first
    if len(flags) == 2:
        return first | flags[1].to(first.device)
    return torch.stack([f.to(first.device).reshape(()) for f in flags]).any()


class OutputFlags:
    """This step's output checks: `add` takes each forward's flags; `last` is the last
    forward's (the replay's), `step_flags` the whole step's so far (the guard's); `take`
    hands the step's to the detector at its end and clears them for the next step."""

    __slots__ = ("_host", "_by_device", "last", "earlier", "first")

    def __init__(self) -> None:
        # no forward of this step checked yet: its check may write its flag where the
        # detector keeps it (Detector.forward_slots), as nothing else holds that slot
        self.first = True
        self._host: bool | None = None  # None: no check on the host this step
        self._by_device: dict[torch.device, torch.Tensor] = {}
        # the last forward's output: True/False when known on the host, a 0-d device bool
        # still to be read, None when it had nothing to check (the replay's)
        self.last: bool | torch.Tensor | None = None
        # the step's forwards before the last, combined (None: the last is the first): the
        # replay covers the last forward, and must know when the NaN was in an earlier one
        self.earlier: bool | torch.Tensor | None = None

    def add(self, flags: list[bool | torch.Tensor]) -> None:
        """One forward's flags: at most one host bool and one flag per device."""
        self.first = False
        if self.last is None and len(flags) == 1 and not self._by_device and self._host is None:
            flag = flags[0]  # the usual step: one forward, one device or the host (no lists, no op)
            if isinstance(flag, torch.Tensor):
                self._by_device[flag.device] = self.last = flag
            else:
                self._host = self.last = bool(flag)
            return
        host = [f for f in flags if not isinstance(f, torch.Tensor)]
        on_device = [f for f in flags if isinstance(f, torch.Tensor)]
        if self.last is not None:  # a second forward of the step: the step so far is earlier
            devices = list(self._by_device.values())
            self.earlier = (
                bool(self._host)
                if self._host or not devices
                else devices[0]
                if len(devices) == 1
                else any_flag(devices)
            )
        if host:
            self._host = bool(self._host) or any(host)
        for f in on_device:
            # a second forward of the step (siamese nets, a discriminator on real and fake)
            # folds in with one op; the first costs none
            earlier = self._by_device.get(f.device)
            self._by_device[f.device] = f if earlier is None else earlier | f
        if any(host):
            self.last = True  # known bad on the host: no device flag needs reading
        elif on_device:
            self.last = any_flag(on_device)
        else:
            self.last = False if host else None

    def add_compiled(self, last: bool | torch.Tensor, any_forward: bool | torch.Tensor) -> None:
        """The compiled forwards' check (traced.py): whether the last forward's output was
        non-finite and whether any of the step's was (it stands for the earlier ones: the
        replay needs only to know that one of them was, when the last was not)."""
        if isinstance(any_forward, torch.Tensor):
            self._by_device[any_forward.device] = any_forward
        else:
            self._host = any_forward
        self.first = False
        self.last = last
        self.earlier = any_forward

    def take(self) -> list[bool | torch.Tensor]:
        """The step's flags (`step_flags`), and the check cleared for the next step: at the
        step's end, where the detector counts them."""
        out: list[bool | torch.Tensor] = [] if self._host is None else [self._host]
        out.extend(self._by_device.values())
        self._host, self._by_device, self.last, self.earlier = None, {}, None, None
        self.first = True
        return out

    def step_flags(self) -> list[bool | torch.Tensor]:
        """The step's output so far: a host bool (if any check ran on the host), then one
        0-d bool per device."""
        out: list[bool | torch.Tensor] = [] if self._host is None else [self._host]
        out.extend(self._by_device.values())
        return out
