"""Which layers' update ratio jumps go on: the event half of the jump rule (issue 43).

Shared by the rule's judge (publish/spikes.py, on the publisher thread) and by the update
replay's mirror of it (integrity/update_replay.py, which decides on the training thread
whether a measured step may begin a jump and so gets a capsule): the two must agree on where
an event begins, so they keep the same state by the same code, each fed the same
measurements.

A layer's event begins when one of its ratios is a jump, and goes on while each of its next
judged ratios stays above half the rule's threshold and margin. While any layer's event goes
on, no measurement begins a new one: a learning rate too large for a while reaches the layers
on their turns (efficiency/updates.py measures a few layers per sampled step), measurements
apart, and is one event.

An event also ends when its layer goes unjudged for `EXPIRY_GAPS` of its usual gaps: a layer
frozen mid-event (no longer measured), given a learning rate of 0 (a ratio of exactly 0 is
neither judged nor kept) or whose updates went non-finite (the NaN checks' business) is never
judged again, and its event, never ended, hid every later jump of the run. Gaps are counted in
measurements of the model (calls of `next_measurement`), not in steps or seconds: layers
take turns, so a layer's own measurements are a fixed number of the model's apart, whatever
the sampling's pace. Its usual gap is the longest of its last `GAPS_KEPT` gaps; an event
needs `MIN_LAYER_HISTORY` (publish/spikes.py) of its layer's ratios before it, so the gaps
are known when it begins.
"""

from __future__ import annotations

from collections import deque

EXPIRY_GAPS = 3  # an event ends after its layer misses this many of its usual gaps
GAPS_KEPT = 8  # the gaps between a layer's measurements that set its usual one


class JumpEvents:
    """The layers whose jump's event goes on. One thread's (the caller's); per measurement of
    the model: `next_measurement()`, then `kept(layer)` for each ratio kept and
    `judged(layer, spike, going)` for each judged."""

    def __init__(self) -> None:
        self._measurement = 0
        self._last: dict[str, int] = {}  # per layer, the measurement that last kept its ratio
        self._gaps: dict[str, deque[int]] = {}  # per layer, its last gaps, in measurements
        self._going: set[str] = set()

    def next_measurement(self) -> bool:
        """A measurement of the model begins: events whose layers have gone unjudged too long
        end. Is an event going on (of any layer)? While one is, none begins."""
        self._measurement += 1
        for layer in [layer for layer in self._going if self._overdue(layer)]:
            self._going.discard(layer)
        return bool(self._going)

    def _overdue(self, layer: str) -> bool:
        gaps = self._gaps.get(layer)
        usual = max(gaps) if gaps else 1
        return self._measurement - self._last.get(layer, 0) > EXPIRY_GAPS * usual

    def kept(self, layer: str) -> None:
        """`layer`'s ratio at this measurement is kept (finite, not 0)."""
        last = self._last.get(layer)
        if last is not None and last < self._measurement:
            self._gaps.setdefault(layer, deque(maxlen=GAPS_KEPT)).append(self._measurement - last)
        self._last[layer] = self._measurement

    def judged(self, layer: str, spike: bool, going: bool) -> None:
        """`layer`'s ratio at this measurement was judged: a jump (`spike`), or above half the
        rule's limits (`going`: its event, if any, goes on)."""
        if spike or (going and layer in self._going):
            self._going.add(layer)
        else:
            self._going.discard(layer)

    @property
    def going(self) -> frozenset[str]:
        """The layers whose event goes on."""
        return frozenset(self._going)
