"""Loss and gradient-norm spikes in the every-step series (issue 43): anomalies that are no NaN.

The publisher thread reads every step's loss and global gradient norm as drains bring them
(step/series.py); nothing is read back on the training thread. Each value is judged against
the `window` finite values before it by a robust z-score, (x - median) / (IQR / 1.349): the
median and the interquartile range of the window (1.349 times the standard deviation, for a
normal distribution), so that the spike itself and the noise of a healthy run hardly move
what it is judged against. The window is kept sorted as values come and go (a bisection each),
so judging a step costs a few microseconds of the publisher's time, whatever the window.
A step is a spike of its kind when its z-score is above the kind's threshold *and* it stands
above the median by a margin of the median's own size (`_MARGIN`: a loss 1e-4 above a
flat median of noise-free steps is no spike, however small the spread); only upward moves count
(a loss that falls is no anomaly). A spike lasts while its steps stay above half the
threshold and half the margin, and counts once: an *event*, with its first step, its value,
the median it stood against and its z-score. Non-finite values are the NaN checks' (never a
spike) and are left out of the window.

No judgement before `MIN_HISTORY` finite values: the first steps of a run (warm-up, a loss
falling fast) have no baseline.

The update-to-weight ratio jumps (`update_ratio_jump`) by the same rule, per layer: each
layer's ratio, on the sampled steps that measure its update (efficiency/updates.py: layers
take turns), is judged against the last `min(window, LAYER_WINDOW)` of its own, from
`MIN_LAYER_HISTORY` of them on, and must stand 4x its median (a margin of three times the
median); a learning rate's warm-up, which raises every ratio steadily, stays well under that.
Why 4x: a layer's ratio drifts over a run (the demo's LayerNorm doubles over 10^4 steps, with
bursts of 2x its recent median), and when its measurements are sparse (a loaded host samples
fewer steps; layers take turns) its window spans thousands of steps: against the older, lower
median a healthy burst read 3.03x at z 13.2 (one of 400 sampling patterns of the demo's
10^4 steps, and one clean-clone CI run). 4x leaves that a third of headroom; a learning
rate 10x too large for one step stands far above it. One event per step however many
layers jump, naming the one whose z-score is highest; it lasts while any layer that jumped
stays above half the threshold and half the margin when next measured, and a layer's part
of it also ends when the layer stops being judged for longer than is usual for it (frozen, a
learning rate of 0, updates gone NaN, no longer measured: step/jump_events.py). Its values
arrive once per measurement (about every `update_norm_interval_s`), so its baseline takes
longer to build than the every-step series'. A ratio of exactly 0 (no update at all: a
multi-task head whose task was not in the step, a learning rate of 0, an expert that got no
tokens) is neither judged nor kept: a layer updated on some steps only is judged against its
updates alone, and one unfrozen mid-run from 20 of its updates on.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from hookprof.snapshot import SPIKE_KINDS, SpikeCount, SpikeEvent
from hookprof.step.jump_events import JumpEvents
from hookprof.step.series import StepValue

KINDS = SPIKE_KINDS
LOSS_SPIKE, GRAD_NORM_SPIKE, UPDATE_RATIO_JUMP = KINDS
MIN_HISTORY = 50  # finite values of a kind before any of its steps is judged
MIN_LAYER_HISTORY = 20  # ... of a layer's update ratio (measured on some sampled steps only)
LAYER_WINDOW = 64  # the most of a layer's ratios kept (a window per layer: bounded memory)
# a spike also stands above the median by this fraction of |median| (or of the scale, if more)
_MARGIN = {LOSS_SPIKE: 0.1, GRAD_NORM_SPIKE: 1.0, UPDATE_RATIO_JUMP: 3.0}
# Config's defaults (loss_spike_z, grad_norm_spike_z, update_ratio_jump_z): healthy runs of
# 10^4 steps (the demo's AdamW, and an MLP with warm-up and a cosine schedule) reached 4.5,
# 8.2 and 9.9 at most (the last at 1.5x its median, under the 4x margin; sparse sampling
# reached z 13.2 at 3.03x, see the module's docstring)
DEFAULT_THRESHOLDS = {LOSS_SPIKE: 8.0, GRAD_NORM_SPIKE: 12.0, UPDATE_RATIO_JUMP: 12.0}


_IQR_SCALE = 1.349  # the interquartile range of a normal distribution, in standard deviations


def quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of sorted values, linearly interpolated (numpy's default)."""
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def centre(ordered: Sequence[float]) -> tuple[float, float]:
    """(median, scale) of sorted finite values: scale is the IQR over 1.349."""
    median = quantile(ordered, 0.5)
    return median, (quantile(ordered, 0.75) - quantile(ordered, 0.25)) / _IQR_SCALE


def robust_z(value: float, ordered: Sequence[float]) -> tuple[float, float, float]:
    """(z, median, scale) of `value` against sorted finite values (`centre`); z is +inf when
    the middle half of them does not vary at all and `value` stands above the median, 0 when
    it does not."""
    median, scale = centre(ordered)
    if scale == 0:
        return (math.inf if value > median else 0.0), median, scale
    return (value - median) / scale, median, scale


class _Window:
    """The last `size` values, in arrival order and sorted."""

    __slots__ = ("_order", "ordered", "_size")

    def __init__(self, size: int):
        self._order: deque[float] = deque()
        self.ordered: list[float] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        if len(self._order) == self._size:
            old = self._order.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        self._order.append(value)
        bisect.insort(self.ordered, value)


def _jump_verdict(
    update: tuple[Any, ...] | None, replay: tuple[Any, ...] | None
) -> tuple[Any, ...] | None:
    """An update ratio jump's verdict from its update's second run (`update`) and, where its
    step's ratio passed the gate, its forward and backward's replay (`replay`): a forward or
    backward that differed came first (the update was made from its gradients), then the
    update's; a replay's alone stands until the update's comes."""
    if replay is not None and replay[0] == "not_reproduced":
        return replay
    if update is not None and replay is not None:
        # (the forward and backward alike: the update's verdict, with its capsule or the
        # batch's, and the batch's samples of largest loss; an update not compared stays
        # not compared, a review's: the replay says nothing of the update)
        return (update[0], update[1] or replay[1], update[2], replay[3], update[4])
    return update or replay


class SpikeWatch:
    """The publisher thread's judge of spikes (see the module's docstring); `counts()` may be
    read from any thread."""

    def __init__(self, window: int, thresholds: Mapping[str, float]):
        self._window = {kind: _Window(window) for kind in (LOSS_SPIKE, GRAD_NORM_SPIKE)}
        self._layer_window_size = min(window, LAYER_WINDOW)
        self._layer_windows: dict[str, _Window] = {}  # update ratios, per layer
        self._layer_events = JumpEvents()  # whose jump's event goes on (step/jump_events.py)
        self._thresholds = dict(thresholds)
        self._in_event = dict.fromkeys((LOSS_SPIKE, GRAD_NORM_SPIKE), False)
        # per kind, the last step whose value was judged: a drain repeats the previous one's
        # last step (step/series.py take), which may bring a loss given after the optimizer
        # ended that step (a late prof.step(loss)): judged then, once
        self._judged = dict.fromkeys(KINDS, 0)
        self._lock = threading.Lock()
        self._counts = {kind: SpikeCount() for kind in KINDS}
        # per kind, the steps its last events began at (a measured update's comparison may
        # come after later steps' packets: update_replay.py decides it once its values reach
        # the host), the last 64
        self._began: dict[str, deque[int]] = {kind: deque(maxlen=64) for kind in KINDS}
        # (loss, gradient norm) above which the spike replay replays a step, then (loss,
        # gradient norm) above which the rule would call it a spike, both against the window
        # of the last drain (read from the training thread: a tuple, replaced whole)
        self.gate_limits = (math.inf, math.inf, math.inf, math.inf)
        self._verdicts: Mapping[int, tuple[Any, ...]] = {}
        self._update_verdicts: Mapping[int, tuple[Any, ...]] = {}
        # per layer, the update ratios above which the spike replay replays a step (half
        # the threshold and margin, as `gate_limits`), then above which the rule would call
        # its next measurement a jump, against its window as it is now (absent: no
        # judgement yet); read from the training thread (integrity/update_replay.py: the
        # gate, an update's capsule), each entry replaced whole
        self.layer_limits: dict[str, tuple[float, float]] = {}

    def observe(self, values: Iterable[StepValue]) -> None:
        for v in values:
            self._judge(LOSS_SPIKE, v.step, v.loss)
            self._judge(GRAD_NORM_SPIKE, v.step, v.grad_norm)
        self.gate_limits = (
            self._gate(LOSS_SPIKE, 0.5),
            self._gate(GRAD_NORM_SPIKE, 0.5),
            self._gate(LOSS_SPIKE, 1.0),
            self._gate(GRAD_NORM_SPIKE, 1.0),
        )

    def _gate(self, kind: str, part: float) -> float:
        """The value above which a step of `kind` is a spike against the window as it is
        now (`part` 1: the rule's own limit, `_rule`), or may be one (`part` 0.5: half the
        threshold and half the margin, the rule's own test of an event going on): looser
        than the rule, so that the spike replay's gate, which uses the window of the last
        drain, replays the steps the rule will call spikes. inf: no judgement yet, or
        detection off."""
        window = self._window[kind]
        if len(window) < MIN_HISTORY:
            return math.inf
        return self._limit(kind, window, part)

    def _limit(self, kind: str, window: _Window, part: float) -> float:
        """The value above which `_rule` calls one of `kind` a spike against `window` (`part`
        1), or an event goes on (`part` 0.5); inf with detection off."""
        threshold = self._thresholds[kind]
        if not math.isfinite(threshold):
            return math.inf
        median, scale = centre(window.ordered)
        margin = _MARGIN[kind] * max(abs(median), scale)
        return median + part * max(threshold * scale, margin)

    def note_verdicts(
        self,
        verdicts: Mapping[int, tuple[Any, ...]],
        update_verdicts: Mapping[int, tuple[Any, ...]] | None = None,
    ) -> None:
        """The spike replay's verdicts by step (integrity/spike_replay.py `Verdict`: the
        result, its capsule, the first layer whose output differed, the batch's samples of
        largest loss, the phase that layer's difference was in), and the update ratio
        jumps' (integrity/update_replay.py: the step's update run again): the events of
        those steps carry theirs, whether they were counted before or after."""
        with self._lock:
            self._verdicts = verdicts
            if update_verdicts is not None:
                self._update_verdicts = update_verdicts
            self._counts = {kind: self._with_verdicts(kind, c) for kind, c in self._counts.items()}

    def _with_verdicts(self, kind: str, count: SpikeCount) -> SpikeCount:
        def of(event: SpikeEvent | None) -> SpikeEvent | None:
            if event is None:
                return None
            if kind == UPDATE_RATIO_JUMP:
                # (judged again as verdicts come: the update's and its step's replay's; once
                # either has forgotten the step, the 64 last kept, the verdict stands)
                update = self._update_verdicts.get(event.step)
                replay = self._verdicts.get(event.step)
                if event.verdict is not None and (update is None or replay is None):
                    return event
                found = _jump_verdict(update, replay)
            elif event.verdict is None:
                found = self._verdicts.get(event.step)
            else:
                return event
            if found is None:
                return event
            verdict, capsule, entered, suspects, phase = found
            return dataclasses.replace(
                event,
                verdict=verdict,
                capsule=capsule,
                entered=entered,
                entered_phase=phase,
                suspects=suspects,
            )

        return SpikeCount(count.count, of(count.first), of(count.last))

    def _judge(self, kind: str, step: int, value: float | None) -> None:
        if value is None or step <= self._judged[kind]:
            return  # not given (yet), or judged already
        self._judged[kind] = step
        if not math.isfinite(value):
            return
        window = self._window[kind]
        if len(window) >= MIN_HISTORY:
            z, median, spike, going = self._rule(kind, value, window)
            if spike and not self._in_event[kind]:
                self._count(kind, SpikeEvent(step, value, median, z))
            self._in_event[kind] = spike or (self._in_event[kind] and going)
        window.add(value)

    def observe_update_ratios(self, step: int, ratios: Mapping[str, float]) -> None:
        """The layers' update-to-weight ratios measured at `step`, each against its own
        layer's window (see the module's docstring)."""
        kind = UPDATE_RATIO_JUMP
        if not ratios or step <= self._judged[kind]:
            return
        self._judged[kind] = step
        ongoing = self._layer_events.next_measurement()  # (an event of any layer's goes on)
        worst: SpikeEvent | None = None
        for layer, value in ratios.items():
            if not math.isfinite(value) or value == 0:
                # a NaN update is the NaN checks'; no update at all (a head without its task
                # this step, lr 0, an expert without tokens) is no baseline and no jump
                self._layer_events.appeared(layer, kept=False)
                continue
            window = self._layer_windows.get(layer)
            if window is None:
                window = self._layer_windows[layer] = _Window(self._layer_window_size)
            if len(window) >= MIN_LAYER_HISTORY:
                z, median, spike, going = self._rule(kind, value, window)
                self._layer_events.judged(layer, spike, going)
                if spike and (worst is None or z > worst.z):
                    worst = SpikeEvent(step, value, median, z, layer)
            window.add(value)
            self._layer_events.appeared(layer, kept=True)
            if len(window) >= MIN_LAYER_HISTORY:
                self.layer_limits[layer] = (
                    self._limit(kind, window, 0.5),
                    self._limit(kind, window, 1.0),
                )
        if worst is not None and not ongoing:
            self._count(kind, worst)

    def _rule(self, kind: str, value: float, window: _Window) -> tuple[float, float, bool, bool]:
        """(z, median, a spike?, an event going on?) of `value` against `window`."""
        z, median, scale = robust_z(value, window.ordered)
        threshold = self._thresholds[kind]
        margin = _MARGIN[kind] * max(abs(median), scale)
        spike = z > threshold and value > median + margin
        # an event goes on while its steps stay well above the window (half the threshold
        # and half the margin: a flat window's z is infinite a hair above its median)
        going = z > threshold / 2 and value > median + margin / 2
        return z, median, spike, going

    def began_at(self, kind: str, step: int) -> bool:
        """Did an event of `kind` begin at `step` (one of the last 64)? Publisher thread."""
        return step in self._began[kind]

    def _count(self, kind: str, event: SpikeEvent) -> None:
        self._began[kind].append(event.step)
        with self._lock:
            old = self._counts[kind]
            count = SpikeCount(old.count + 1, old.first or event, event)
            self._counts[kind] = self._with_verdicts(kind, count)

    def counts(self) -> Mapping[str, SpikeCount]:
        with self._lock:
            return MappingProxyType(dict(self._counts))
