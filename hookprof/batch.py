"""Gathering one step's device scalars into one tensor per device, and reading them back."""

from __future__ import annotations

from typing import Any

import torch

from . import transfer


class ScalarBatch:
    """Named groups of device scalars, concatenated per device and sent to the host with one
    `transfer.to_host` call per device (one in all for a single-device model)."""

    def __init__(self) -> None:
        self._parts: dict[torch.device, list[torch.Tensor]] = {}
        self._sizes: dict[torch.device, int] = {}
        self._where: dict[Any, list[tuple[torch.device, int, int]]] = {}

    def add(self, key: Any, values: torch.Tensor) -> None:
        """Append a 0-d or 1-d tensor under `key` (a key may collect several tensors)."""
        flat = values.reshape(-1)
        device = flat.device
        offset = self._sizes.get(device, 0)
        self._parts.setdefault(device, []).append(flat)
        self._sizes[device] = offset + flat.numel()
        self._where.setdefault(key, []).append((device, offset, flat.numel()))

    def send(self) -> "HostBatch":
        sent = {}
        for device, parts in self._parts.items():
            # cat promotes int64 counts and low-precision floats; float64 holds both exactly
            flat = torch.cat(parts).to(torch.float64)
            sent[device] = transfer.to_host(flat)
        return HostBatch(self._where, sent)


class HostBatch:
    """The host side: wait once, then look the values up by key."""

    def __init__(self, where: dict[Any, list[tuple[torch.device, int, int]]], sent: dict):
        self._where = where
        self._sent = sent
        self._lists: dict[torch.device, list[float]] | None = None

    def wait(self) -> None:
        if self._lists is None:
            for _, ready in self._sent.values():
                transfer.wait_ready(ready)
            # host tensors only (the copy above has completed): no device is touched here
            self._lists = {d: host.tolist() for d, (host, _) in self._sent.items()}

    def get(self, key: Any) -> list[float]:
        self.wait()
        assert self._lists is not None
        out: list[float] = []
        for device, offset, n in self._where.get(key, ()):
            out.extend(self._lists[device][offset : offset + n])
        return out
