"""The first-NaN scenarios of issue 28, written once: small models, the way each one makes
its first NaN/Inf, and the plain loop that trains them (on the CPU, or on the emulated device
`lag` optimizer steps behind the host: support.lagging_device).

Each scenario knows, independently of hookprof, where its first NaN/Inf is made (the layer
it poisons, the step it picks) and what hookprof must then say under each policy and lag
(`Scenario.expected`): that is what the tests compare hookprof's answer with.

- WeightNaN: a CNN whose `features.3.weight[0,0,0,0]` is set to NaN before step `at`'s
  forward (a user's or a loader's doing: no non-finite update came before it).
- Poison: a parameterless layer that makes a NaN at its `call`-th call only (stateful: a
  replay of that step's forward, a later call, is finite): seen on a sampled, checked step
  it is named; on an unsampled one it is transient.
- Overflow: one batch row of step `at` is large but finite (3e38, signed like fc1's first
  weight row) so that fc1's output overflows to Inf: reproducible from the data.
- BackwardNaN: the gradient fc2 receives in the backward of step `at` is NaN (the forward
  is finite): first in backward. Its model registers fc2 before fc1 though fc1 runs first,
  so module order and backward order disagree: only the sampled step's backward timing
  names fc2 (module order alone would say fc1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hookprof
from hookprof.nonfinite.replay import BEHIND, LATER_WEIGHTS
from hookprof.snapshot import (
    FoundBy,
    ReplayOutcome,
)
from support.lagging_device import lagging_device

LAGS = (0, 1, 3)
# every step sampled, and every sampled step checked (per-layer output checks)
EVERY_STEP_CHECKED = dict(
    port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0
)
# step 1 sampled only (until an incident opens), however slow a loaded machine makes the steps
UNSAMPLED = dict(port=0, sample_every=1000, min_sample_interval_s=3600.0)


# ---------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """features (conv, relu, pool, conv, relu, pool) -> head: `features.3` is a conv."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, classes)
        self.classes = classes

    def forward(self, x):
        return self.head(self.features(x).flatten(1))

    def batch(self, g: torch.Generator, size: int = 4):
        return torch.randn(size, 3, 8, 8, generator=g), torch.randint(
            0, self.classes, (size,), generator=g
        )


class PoisonAt(nn.Module):
    """No parameters; its output is NaN at its `call`-th call (counted over every call,
    hookprof's replay included), its input unchanged otherwise."""

    def __init__(self, call: int):
        super().__init__()
        self.call = call
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + float("nan") if self.calls == self.call else x * 1.0


class PoisonNet(nn.Module):
    """fc1 -> poison -> act -> fc2."""

    def __init__(self, call: int):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.poison = PoisonAt(call)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.act(self.poison(self.fc1(x))))

    def batch(self, g: torch.Generator, size: int = 8):
        x = torch.randn(size, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True)


class Mlp(nn.Module):
    """fc1 -> act -> fc2."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

    def batch(self, g: torch.Generator, size: int = 8):
        x = torch.randn(size, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True)


class BackwardsMlp(nn.Module):
    """fc1 -> act -> fc2, with fc2 registered first: module order (fc2, fc1, act) is not
    the call order, so the layer order alone does not say which gradient went bad first."""

    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(16, 1)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.poisoned = False  # the gradient fc2's output receives is NaN while True

    def forward(self, x):
        out = self.fc2(self.act(self.fc1(x)))
        if self.poisoned and out.requires_grad:
            out.register_hook(lambda g: g * float("nan"))
        return out

    def batch(self, g: torch.Generator, size: int = 8):
        x = torch.randn(size, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True)


# ---------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Outcome:
    """What hookprof must say of the first NaN/Inf: (layer, phase, step, found_by, replay),
    and the reason when not replayed."""

    layer: str | None
    phase: str
    step: int
    found_by: str | None
    replay: str | None
    replay_note: str | None = None

    @property
    def key(self) -> tuple:
        return (self.layer, self.phase, self.step, self.found_by, self.replay)


def event_key(event: Any) -> tuple:
    """The same five of a NonFiniteEvent (None: no event)."""
    if event is None:
        return None
    return (event.layer, event.phase, event.step, event.found_by, event.replay)


class Scenario:
    name = ""
    at = 0  # the step whose forward (or backward) makes the first NaN/Inf
    settings: dict = UNSAMPLED

    def make_model(self) -> nn.Module:
        raise NotImplementedError

    def before_step(self, step: int, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Called before each training step's forward; returns the inputs to use."""
        return inputs

    def expected(self, lag: int, policy: str) -> Outcome:
        raise NotImplementedError

    def steps(self, lag: int) -> int:
        """Long enough for the flag of the bad step to arrive, a late replay to run, and a
        few steps of the incident after it."""
        return self.at + 2 * lag + 4


def _not_replayed(
    layer_phase_step: tuple[str, int], lag: int, policy: str
) -> tuple[str, str] | None:
    """What a device `lag` steps behind under `policy` makes of a forward NaN of an unsampled
    step, with the loop's fused optimizer: None when the replay runs (lag 0: at once; skip
    and raise hold the fused update back and replay late), else (ReplayOutcome.NOT_REPLAYED, why)."""
    if lag == 0 or policy in ("skip", "raise"):
        return None
    return (
        ReplayOutcome.NOT_REPLAYED,
        BEHIND,
    )  # record: the update reached the weights before the flag came


def _finite_replay(lag: int, policy: str) -> tuple[str, str | None]:
    """What a replay that comes out finite says: transient only on the step's own weights
    (lag 0: replayed before the update); a late replay (skip/raise, held back) ran after
    later updates, so no verdict; under record on a device behind, no replay at all."""
    if lag == 0:
        return ReplayOutcome.TRANSIENT, None
    if policy in ("skip", "raise"):
        return ReplayOutcome.NOT_REPLAYED, LATER_WEIGHTS
    return ReplayOutcome.NOT_REPLAYED, BEHIND


class WeightNaN(Scenario):
    name = "nan weight"
    layer = "features.3"

    def __init__(self, at: int = 5):
        self.at = at

    def make_model(self):
        torch.manual_seed(0)
        return SmallCNN()

    def before_step(self, step, model, inputs):
        if step == self.at:
            with torch.no_grad():
                model.features[3].weight[0, 0, 0, 0] = float("nan")
        return inputs

    def expected(self, lag, policy):
        if _not_replayed(None, lag, policy):
            return Outcome(None, "forward", self.at, None, ReplayOutcome.NOT_REPLAYED, BEHIND)
        return Outcome(self.layer, "forward", self.at, FoundBy.WEIGHTS, ReplayOutcome.REPRODUCIBLE)


class SampledPoison(Scenario):
    """The poison on a sampled, checked step: named from that step's checks, whatever else."""

    name = "poison, sampled"
    settings = EVERY_STEP_CHECKED
    layer = "poison"

    def __init__(self, at: int = 7):
        self.at = at  # one forward per step: its `at`-th call is step `at`'s

    def make_model(self):
        torch.manual_seed(0)
        return PoisonNet(self.at)

    def expected(self, lag, policy):
        # the sampled step names it; its replay (the poison's next call) is finite, which is
        # a verdict only on the step's own weights (lag 0); a late replay runs after other
        # updates (skip, raise), and under record on a device behind there is none
        return Outcome(
            self.layer, "forward", self.at, FoundBy.SAMPLED, *_finite_replay(lag, policy)
        )


class TransientPoison(SampledPoison):
    """The poison on an unsampled step: its replay (a later call) is finite."""

    name = "poison, unsampled"
    settings = UNSAMPLED

    def expected(self, lag, policy):
        return Outcome(None, "forward", self.at, None, *_finite_replay(lag, policy))


class Overflow(Scenario):
    """Row 0 of step `at`'s batch is 3e38 signed like fc1's first weight row: finite, but
    fc1's first output is then 3e38 * sum|w| > float32's max, an Inf."""

    name = "overflowing row"
    layer = "fc1"

    def __init__(self, at: int = 5):
        self.at = at

    def make_model(self):
        torch.manual_seed(0)
        return Mlp()

    def before_step(self, step, model, inputs):
        if step != self.at:
            return inputs
        inputs = inputs.clone()
        inputs[0] = 3e38 * torch.sign(model.fc1.weight[0].detach())
        assert torch.isfinite(inputs).all()
        with torch.no_grad():  # the precondition, checked apart from hookprof
            assert not torch.isfinite(
                nn.functional.linear(inputs, model.fc1.weight, model.fc1.bias)
            ).all()
        return inputs

    def expected(self, lag, policy):
        if _not_replayed(None, lag, policy):
            return Outcome(None, "forward", self.at, None, ReplayOutcome.NOT_REPLAYED, BEHIND)
        return Outcome(self.layer, "forward", self.at, FoundBy.REPLAY, ReplayOutcome.REPRODUCIBLE)


class BackwardNaN(Scenario):
    """The gradient into fc2 is NaN at step `at` (every step sampled, so its backward is
    timed): the first NaN is in backward, first in fc2."""

    name = "nan first in backward"
    settings = EVERY_STEP_CHECKED
    layer = "fc2"

    def __init__(self, at: int = 4):
        self.at = at

    def make_model(self):
        torch.manual_seed(0)
        return BackwardsMlp()

    def before_step(self, step, model, inputs):
        model.poisoned = step == self.at
        return inputs

    def expected(self, lag, policy):
        return Outcome(self.layer, "backward", self.at, FoundBy.BACKWARD, None)

    def steps(self, lag):
        return self.at + 10  # training goes on: ten more sampled steps after the first NaN


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "nan_weight": WeightNaN,
    "sampled_poison": SampledPoison,
    "transient_poison": TransientPoison,
    "overflow": Overflow,
    "backward_nan": BackwardNaN,
}


# ---------------------------------------------------------------- the loop


def loss_of(model: nn.Module, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return nn.functional.cross_entropy(out, target)
    return nn.functional.mse_loss(out, target)


def fused_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with its fused kernel: under skip/raise hookprof holds a non-finite update back on
    the (emulated) device through found_inf, so a late replay runs on intact weights."""
    return torch.optim.SGD(model.parameters(), lr=0.01, fused=True)


def behind_by(lag: int):
    """The emulated device `lag` optimizer steps behind the host (its LaggingDevice), or the
    plain CPU for lag 0 (None)."""
    return lagging_device(lag) if lag else contextlib.nullcontext()


@dataclass
class Run:
    model: nn.Module
    prof: Any  # detached when run() returns, unless keep_attached
    snapshot: Any  # after flush()
    error: BaseException | None  # the NonFiniteError, under raise
    error_step: int | None  # the loop step it was raised at
    device_waits: list[str]


def run(
    scenario: Scenario,
    *,
    lag: int,
    policy: str,
    steps: int,
    publisher: Any = None,
    settings: dict | None = None,
    on_step: Callable[[int, Any], None] | None = None,
    keep_attached: bool = False,
    **more: Any,
) -> Run:
    """Train `scenario`'s model for `steps` with hookprof attached (scenario.settings, then
    `settings`, on_nonfinite=policy, `more`), on the emulated device `lag` steps behind the
    host (lag 0: the plain CPU), with a fused SGD; stop at a NonFiniteError. `publisher`: a
    Publisher subclass (hookprof.Profiler's keyword), for tests that capture packets."""
    model = scenario.make_model()
    opt = fused_sgd(model)
    g = torch.Generator().manual_seed(1)
    config = hookprof.Config(summary_at_exit=False).replace(
        **{**scenario.settings, **(settings or {}), "on_nonfinite": policy, **more}
    )
    error, error_step, waits = None, None, []
    with behind_by(lag) as device:
        if publisher is not None:
            prof = hookprof.Profiler(model, config, publisher=publisher)
        else:
            prof = hookprof.attach(model, config=config)
        try:
            for step in range(1, steps + 1):
                inputs, target = model.batch(g)
                inputs = scenario.before_step(step, model, inputs)
                opt.zero_grad(set_to_none=True)
                loss_of(model, model(inputs), target).backward()
                opt.step()
                if on_step is not None:
                    on_step(step, prof)
        except hookprof.NonFiniteError as exc:
            error, error_step = exc, step
        finally:
            try:
                if device is not None:
                    waits = list(device.waits)
                prof.flush()
            finally:
                if not keep_attached:
                    prof.detach()
    return Run(model, prof, prof.snapshot(), error, error_step, waits)
