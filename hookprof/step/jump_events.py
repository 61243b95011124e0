"""Which layers' update ratio jumps go on: the event half of the jump rule (issue 43).

Used by the rule's judge (publish/spikes.py, on the publisher thread) and by the update
replay's mirror of it (integrity/update_replay.py, which decides on the training thread
whether a measured step may begin a jump, and so gets a capsule): the same code, so that
the two agree wherever they are given the same measurements (the mirror's are close to the
rule's, not always the same: see update_replay.py).

A layer's event begins when one of its ratios is a jump, and goes on while each of its next
judged ratios stays above half the rule's threshold and margin. While any layer's event goes
on, no measurement begins a new one: a learning rate too large for a while reaches the layers
on their turns (efficiency/updates.py measures a few layers per sampled step), measurements
apart, and is one event.

A layer may stop being judged in the middle of its event, and then its event must still end
(before, it never did, and hid every later jump of the run). Two ways, each against the
layer's own history, since what is usual differs from layer to layer:
- it still *appears* (it has its turn, its weight is above 0) but its ratio is not kept: 0
  (frozen, a learning rate of 0, a multi-task head or an expert without work this step) or
  non-finite (the NaN checks' business). Its event ends once it has appeared more than
  `EXPIRY` times its usual run of such appearances in a row (the longest of its last
  `RUNS_KEPT` runs, at least 1, at most `LONGEST_RUN`: a layer paused for thousands of
  steps once must not keep a later event open for thousands more);
- it no longer appears at all (its weight went to 0 or NaN, or it left the rotation): its
  event ends once more than `ABSENT_EXPIRY` times its usual gap between appearances (the
  median of its last `RUNS_KEPT`: one long absence, a layer unfrozen after thousands of
  steps, does not set it) has passed, counted in measurements of the model. Gaps are the
  rotation's length, which varies as turns are packed by bytes and grows when a parameter
  group joins (progressive unfreezing), hence the generous factor; a rotation that grows
  more than 8x in the middle of an event (a small model measured whole at every step that
  gains many groups) ends it early, and one incident counts as two events.
"""

from __future__ import annotations

from collections import deque

EXPIRY = 3  # appearances without a kept ratio, in usual runs of them, before the event ends
ABSENT_EXPIRY = 8  # measurements without an appearance, in usual gaps, before it ends
RUNS_KEPT = 8  # the runs and gaps that set what is usual for a layer
LONGEST_RUN = 64  # the most a usual run of unkept appearances counts for


class JumpEvents:
    """The layers whose jump's event goes on. One thread's (the caller's); per measurement of
    the model: `next_measurement()`, then, for each layer that appears in it, `judged(layer,
    spike, going)` if its ratio was judged and `appeared(layer, kept)`."""

    def __init__(self) -> None:
        self._measurement = 0
        self._going: set[str] = set()
        self._appeared: dict[str, int] = {}  # per layer, the measurement it last appeared in
        self._gaps: dict[str, deque[int]] = {}  # ... its last gaps between appearances
        self._unkept: dict[str, int] = {}  # ... its appearances since its ratio was last kept
        self._runs: dict[str, deque[int]] = {}  # ... its last runs of unkept appearances

    def next_measurement(self, at: int | None = None) -> bool:
        """A measurement of the model begins (the `at`-th, where the caller counts them
        itself): events whose layers have gone unjudged too long end. Is an event going on
        (of any layer)? While one is, none begins."""
        self._measurement = self._measurement + 1 if at is None else at
        for layer in [layer for layer in self._going if self._overdue(layer)]:
            self._going.discard(layer)
        return bool(self._going)

    def _overdue(self, layer: str) -> bool:
        run = min(max(self._runs.get(layer, ()), default=1), LONGEST_RUN)
        if self._unkept.get(layer, 0) > EXPIRY * run:
            return True
        gaps = sorted(self._gaps.get(layer, ()))
        gap = gaps[len(gaps) // 2] if gaps else 1  # (the median, the upper of two middles)
        return self._measurement - self._appeared.get(layer, 0) > ABSENT_EXPIRY * gap

    def judged(self, layer: str, spike: bool, going: bool) -> None:
        """`layer`'s ratio at this measurement was judged: a jump (`spike`), or above half the
        rule's limits (`going`: its event, if any, goes on)."""
        if spike or (going and layer in self._going):
            self._going.add(layer)
        else:
            self._going.discard(layer)

    def appeared(self, layer: str, kept: bool) -> None:
        """`layer` appears in this measurement (its turn, a weight above 0); `kept`: its ratio
        was finite and not 0."""
        last = self._appeared.get(layer)
        if last is not None and last < self._measurement:
            self._gaps.setdefault(layer, deque(maxlen=RUNS_KEPT)).append(self._measurement - last)
        self._appeared[layer] = self._measurement
        if not kept:
            self._unkept[layer] = self._unkept.get(layer, 0) + 1
            return
        run = self._unkept.pop(layer, 0)
        if run:
            self._runs.setdefault(layer, deque(maxlen=RUNS_KEPT)).append(run)
