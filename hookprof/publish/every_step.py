"""Every step's loss and global gradient norm for the report and `top` (issue 41): the run up
to an incident step by step, in memory fixed however long the run.

Fed on the publisher thread with the values a drain brought (step/series.py `decode`):

- `recent`: the last `FULL` steps at full resolution. A drain brings the last RING steps
  again each time, so a step's values may come twice: a late loss fills the first one's gap.
- `lead_up`: the `LEAD_UP` steps before the run's first non-finite step, that step and
  `AFTER` steps after it, kept at full resolution for good once it is known.
- `bands`: every step that left `recent`, `MAX_BANDS` bands at most, each with the minimum,
  maximum and mean of the finite values it covers and its count of non-finite ones; when
  full, neighbours merge pairwise and each new band covers twice as many steps (History's
  scheme), so the shape of the whole run stays, spikes included (the maximum survives).

A value is stored as History stores one: NaN for none, +inf for a non-finite one.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import deque
from collections.abc import Iterable
from typing import Any

from hookprof.step.series import StepValue

FULL = 512
LEAD_UP = 256
AFTER = 32
MAX_BANDS = 512

_BAND_COLUMNS = (
    "first",
    "last",
    "loss_min",
    "loss_max",
    "loss_mean",
    "loss_n",
    "loss_bad",
    "grad_norm_min",
    "grad_norm_max",
    "grad_norm_mean",
    "grad_norm_n",
    "grad_norm_bad",
    "step_seconds_min",
    "step_seconds_max",
    "step_seconds_mean",
    "step_seconds_n",
    "step_seconds_bad",
)
_VALUES = ("loss", "grad_norm", "step_seconds")  # a row: [step, *_VALUES]


def stored(value: float | None) -> float:
    """How a number is kept (here and in History): NaN for none, +inf for a non-finite one."""
    if value is None:
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.inf


class EveryStep:
    """Owned by the publisher thread, which calls `observe`; anyone may call `view`."""

    def __init__(self, *, full: int = FULL, lead_up: int = LEAD_UP, max_bands: int = MAX_BANDS):
        if max_bands < 2 or max_bands % 2:
            raise ValueError(f"max_bands must be an even number >= 2, got {max_bands}")
        self._lock = threading.Lock()
        self.recent: deque[list[float]] = deque()  # [step, loss, grad_norm, step_seconds]
        self._full = full
        self._lead_up_steps = lead_up
        self.lead_up: list[list[float]] = []
        self.incident: int | None = None  # the first step with a non-finite loss or norm
        self._bands = {name: array("d") for name in _BAND_COLUMNS}
        self.max_bands = max_bands
        self.stride = 1  # steps per band, doubled at each halving

    # ---------------- feeding (publisher thread) ----------------

    def observe(self, values: Iterable[StepValue], incident: int | None = None) -> None:
        """The values a drain brought (in step order); `incident`: the run's first
        non-finite step as the counters say (a NaN in a layer's output may come before the
        loss is one), when known."""
        with self._lock:
            for v in values:
                row = [float(v.step), stored(v.loss), stored(v.grad_norm), stored(v.step_seconds)]
                if not self._update(row):
                    self._append(row)
                bad = math.isinf(row[1]) or math.isinf(row[2])
                if self.incident is None and bad:
                    self._mark(v.step)
            if incident is not None and (self.incident is None or incident < self.incident):
                self._mark(incident)

    def _update(self, row: list[float]) -> bool:
        """A step seen before: its missing values filled (a late loss). False: a new step."""
        if not self.recent or row[0] > self.recent[-1][0]:
            return False
        for old in reversed(self.recent):  # (the newest first: where a repeated step is)
            if old[0] == row[0]:
                for k in (1, 2, 3):
                    if row[k] == row[k]:
                        old[k] = row[k]
                self._lead(old)
                return True
            if old[0] < row[0]:
                break
        return True  # older than what is kept: already folded into a band

    def _append(self, row: list[float]) -> None:
        self.recent.append(row)
        self._lead(row)
        while len(self.recent) > self._full:
            self._band(self.recent.popleft())

    def _mark(self, step: int) -> None:
        self.incident = step
        low = step - self._lead_up_steps
        self.lead_up = [list(r) for r in self.recent if low <= r[0] <= step + AFTER]

    def _lead(self, row: list[float]) -> None:
        """A row of the incident's window, kept there too (a copy: the window stays)."""
        if self.incident is None or not (
            self.incident - self._lead_up_steps <= row[0] <= self.incident + AFTER
        ):
            return
        for old in reversed(self.lead_up):
            if old[0] == row[0]:
                old[:] = row
                return
        self.lead_up.append(list(row))
        self.lead_up.sort()

    def _band(self, row: list[float]) -> None:
        """A step leaving `recent`, folded into the open band (or a new one)."""
        b = self._bands
        n = len(b["first"])
        if n and b["last"][n - 1] - b["first"][n - 1] + 1 < self.stride:
            i = n - 1
        else:
            if n == self.max_bands:
                self._halve()
                b = self._bands  # (a new dict)
            for name in _BAND_COLUMNS:
                b[name].append(math.nan if name.endswith(("min", "max", "mean")) else 0.0)
            i = len(b["first"]) - 1
            b["first"][i] = row[0]
        b["last"][i] = row[0]
        for k, col in enumerate(_VALUES, start=1):
            v = row[k]
            if v != v:
                continue
            if math.isinf(v):
                b[f"{col}_bad"][i] += 1
                continue
            n_before = b[f"{col}_n"][i]
            b[f"{col}_min"][i] = v if n_before == 0 else min(b[f"{col}_min"][i], v)
            b[f"{col}_max"][i] = v if n_before == 0 else max(b[f"{col}_max"][i], v)
            mean = b[f"{col}_mean"][i]
            b[f"{col}_mean"][i] = v if n_before == 0 else mean + (v - mean) / (n_before + 1)
            b[f"{col}_n"][i] = n_before + 1

    def _halve(self) -> None:
        b = self._bands
        n = len(b["first"])
        merged: dict[str, array] = {name: array("d") for name in _BAND_COLUMNS}
        for j in range(0, n - 1, 2):
            merged["first"].append(b["first"][j])
            merged["last"].append(b["last"][j + 1])
            for col in _VALUES:
                na, nb = b[f"{col}_n"][j], b[f"{col}_n"][j + 1]
                pick = [k for k, m in ((j, na), (j + 1, nb)) if m]
                merged[f"{col}_n"].append(na + nb)
                merged[f"{col}_bad"].append(b[f"{col}_bad"][j] + b[f"{col}_bad"][j + 1])
                merged[f"{col}_min"].append(
                    min((b[f"{col}_min"][k] for k in pick), default=math.nan)
                )
                merged[f"{col}_max"].append(
                    max((b[f"{col}_max"][k] for k in pick), default=math.nan)
                )
                merged[f"{col}_mean"].append(
                    sum(b[f"{col}_mean"][k] * b[f"{col}_n"][k] for k in pick) / (na + nb)
                    if pick
                    else math.nan
                )
        self._bands = merged
        self.stride *= 2

    # ---------------- reading (any thread) ----------------

    def tail(self, n: int, *, lead_up: bool = False) -> dict[str, Any]:
        """The last `n` steps (`top`'s line of recent steps), as `view()["full"]` has them;
        with `lead_up`, the last `n` up to the first non-finite one (none before it)."""
        with self._lock:
            if lead_up:
                rows = [r for r in self.lead_up if r[0] <= (self.incident or 0)][-n:]
            else:
                rows = list(self.recent)[-n:] if n > 0 else []
            return _columns(rows)

    def view(self) -> dict[str, Any]:
        """A copy in plain Python: None for no value, math.inf for a non-finite one. `full`:
        the lead-up's steps older than `recent`, then `recent`, each step once, in order."""

        def plain(v: float) -> float | None:
            return None if v != v else v

        with self._lock:
            oldest = self.recent[0][0] if self.recent else math.inf
            rows = [r for r in self.lead_up if r[0] < oldest] + list(self.recent)
            return {
                "full": _columns(rows),
                "bands": {name: [plain(v) for v in col] for name, col in self._bands.items()},
                "stride": self.stride,
                "incident": self.incident,
            }


def _columns(rows: list[list[float]]) -> dict[str, list[Any]]:
    """Rows as columns in plain Python: None for no value."""
    out: dict[str, list[Any]] = {"step": [r[0] for r in rows]}
    for k, name in enumerate(_VALUES, start=1):
        out[name] = [None if r[k] != r[k] else r[k] for r in rows]
    return out
