"""Issues 12 and 13, on every commit: hookprof adds no host-device synchronisation on the
training thread (outside `Profiler.flush()`), checked on the CPU.

Each loop a user writes runs on an emulated device that is `LAG` optimizer steps behind the
host (tests/support/lagging_device.py: hookprof takes its accelerator code paths) under a
SyncWatch (tests/support/sync_watch.py), which records every op that would make the host wait
for a GPU and whose code asked for it. Steps include sampled ones (every third step) with
every feature on (activation statistics, update norms, FLOPs, phases), and a NaN made in a
layer's forward at an unsampled step, under each on_nonfinite policy. The user's own waits
(`loss.item()` each step) are allowed and seen, and the tests that end this file show the
watch failing on a wait put into hookprof."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from hookprof.device import transfer
from support.inject import StepInjector
from support.lagging_device import lagging_device
from support.models import DeepNet, Discriminator, Generator, loss_of, seeded
from support.sync_watch import SyncWatch

LAG = 3
STEPS = 14
BAD_STEP = 5  # unsampled: steps 1, 4, 7 are sampled (sample_every=3) until the NaN
SAMPLED = dict(
    port=0,
    sample_every=3,
    min_sample_interval_s=0.0,
    activation_interval_s=0.0,
    update_norm_interval_s=0.0,
)
POLICIES = ["record", "skip", "raise"]


@pytest.fixture(autouse=True)
def nothing_left_patched():
    """The emulation, the watch and the bugs put into hookprof below all replace functions
    of hookprof.device.transfer: every one is back after each test (later files would otherwise run
    with flags that are never on the host)."""
    names = ("on_host", "peek", "is_ready", "wait_ready")
    before = [getattr(transfer, n) for n in names] + [getattr(*_testing.device_copy_seam())]
    yield
    assert [getattr(transfer, n) for n in names] + [getattr(*_testing.device_copy_seam())] == before


def watched(model_or_models, settings: dict | None, loop, *, lag: int = LAG):
    """Attach hookprof (Config overrides `settings`; None: the default configuration) to
    each model, run `loop()` with both under the watch, then flush (inside the watch: waits
    are allowed there), snapshot and detach (inside too). Returns (watch, snapshots, error
    raised by the loop under on_nonfinite="raise" or None)."""
    models = model_or_models if isinstance(model_or_models, (list, tuple)) else [model_or_models]
    settings = dict(port=0) if settings is None else settings
    error = None
    with lagging_device(lag), SyncWatch() as watch:
        profs = [hookprof.attach(m, **settings) for m in models]
        try:
            loop()
        except hookprof.NonFiniteError as exc:
            error = exc
        finally:
            snaps = []
            for prof in profs:
                prof.flush()
                snaps.append(prof.snapshot())
                prof.detach()
    return watch, snaps, error


def assert_no_hookprof_sync(watch: SyncWatch) -> None:
    assert watch.hookprofs == [], watch.report()
    assert watch.early_reads == [], watch.report()


def assert_nan_seen(snap, error, policy: str) -> None:
    """The NaN path really ran: the incident was raised or counted, at the bad step. (On a
    device behind the host "raise" acts once the publisher has folded the late flag in, on
    its own clock: within the loop or not, so either is accepted.)"""
    event = error if error is not None else snap.first_nonfinite
    assert event is not None and event.step == BAD_STEP
    assert error is None or policy == "raise"


# -- the loops ---------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adam foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "adamw fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adamw foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
}


def plain_loop(model, opt, injector, *, user_item: bool = True, steps: int = STEPS):
    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, model.batch(g))
            loss.backward()
            opt.step()
            if user_item:
                loss.item()  # the user's own wait: allowed, not hookprof's

    return loop


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_mlp_with_each_optimizer_and_policy(kind, policy):
    model = seeded(DeepNet)
    opt = OPTIMIZERS[kind](model.parameters())
    watch, (snap,), error = watched(
        model,
        dict(SAMPLED, on_nonfinite=policy),
        plain_loop(model, opt, StepInjector(model.blocks[1].act, {BAD_STEP})),
    )
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)
    assert len(watch.by("user")) >= BAD_STEP - 1  # the loop's own loss.item() calls were seen
    assert all(w.frame.startswith("test_no_sync_emulated.py") for w in watch.by("user"))


@pytest.mark.parametrize("check", ["all", "loss"])
def test_default_configuration(check):
    model = seeded(DeepNet)
    opt = OPTIMIZERS["adamw fused"](model.parameters())
    settings = dict(port=0, nonfinite_check=check)
    watch, (snap,), _ = watched(
        model, settings, plain_loop(model, opt, StepInjector(model.blocks[2].fc, {BAD_STEP}))
    )
    assert_no_hookprof_sync(watch)
    assert snap.step == STEPS and snap.first_nonfinite.step == BAD_STEP


def test_loss_only_check_with_sampled_steps():
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    watch, (snap,), _ = watched(
        model,
        dict(SAMPLED, nonfinite_check="loss", on_nonfinite="skip"),
        plain_loop(model, opt, StepInjector(model.blocks[0].fc, {BAD_STEP})),
    )
    assert_no_hookprof_sync(watch)
    assert snap.first_nonfinite.step == BAD_STEP


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))

    def batch(self, g):
        x = torch.randn(6, 3, 8, 8, generator=g)
        return x, torch.randint(0, 4, (6,), generator=g)


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_convnet(policy):
    model = seeded(ConvNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    watch, (snap,), error = watched(
        model,
        dict(SAMPLED, on_nonfinite=policy),
        plain_loop(model, opt, StepInjector(model.bn1, {BAD_STEP})),
    )
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_model_called_twice_per_step(policy):
    model = seeded(DeepNet)
    opt = OPTIMIZERS["adam fused"](model.parameters())
    injector = StepInjector(model.blocks[3].fc, {BAD_STEP})

    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            injector.step = step
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, model.batch(g)) + loss_of(model, model.batch(g))
            loss.backward()
            opt.step()

    watch, (snap,), error = watched(model, dict(SAMPLED, on_nonfinite=policy), loop)
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_gan_with_two_optimizers(policy):
    """Two models, two profilers, two optimizers; the discriminator runs three times a step."""
    gen, disc = seeded(Generator), seeded(Discriminator, seed=1)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, fused=True)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, foreach=True)
    injector = StepInjector(gen.net[0], {BAD_STEP})
    bce = nn.functional.binary_cross_entropy_with_logits

    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            injector.step = step
            real = torch.randn(8, 8, generator=g)
            fake = gen(torch.randn(8, 4, generator=g))
            opt_d.zero_grad(set_to_none=True)
            d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=True)
            g_loss = bce(disc(fake), torch.ones(8, 1))
            g_loss.backward()
            opt_g.step()

    watch, (snap_g, _), error = watched([gen, disc], dict(SAMPLED, on_nonfinite=policy), loop)
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap_g, error, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_hand_written_optimizer_with_explicit_steps(policy):
    """No torch.optim: the update is the user's own, steps end with prof.step(loss)."""
    model = seeded(DeepNet)
    injector = StepInjector(model.blocks[1].fc, {BAD_STEP})
    profs = []

    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            injector.step = step
            for p in model.parameters():
                p.grad = None
            loss = loss_of(model, model.batch(g))
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.05 * p.grad)
            profs[0].step(loss)

    settings = dict(SAMPLED, on_nonfinite=policy)
    original_attach = hookprof.attach

    def attach(m, **kw):  # keep the profiler the helper makes, for prof.step()
        profs.append(original_attach(m, **kw))
        return profs[-1]

    hookprof.attach = attach
    try:
        watch, (snap,), error = watched(model, settings, loop)
    finally:
        hookprof.attach = original_attach
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)


class DictNet(DeepNet):
    def forward(self, x):
        out = super().forward(x)
        return {"prediction": out, "aux": out.detach() * 0.5}


@pytest.mark.parametrize("policy", POLICIES)
def test_dict_outputs(policy):
    model = seeded(DictNet)
    opt = OPTIMIZERS["adamw foreach"](model.parameters())
    injector = StepInjector(model.blocks[2].act, {BAD_STEP})

    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            injector.step = step
            x, y = model.batch(g)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x)["prediction"], y)
            loss.backward()
            opt.step()

    watch, (snap,), error = watched(model, dict(SAMPLED, on_nonfinite=policy), loop)
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_lbfgs_closure_steps(policy):
    model = seeded(DeepNet)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    injector = StepInjector(model.blocks[0].act, {BAD_STEP})

    def loop():
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            injector.step = step
            batch = model.batch(g)

            def closure(batch=batch):
                opt.zero_grad(set_to_none=True)
                loss = loss_of(model, batch)
                loss.backward()
                return loss

            opt.step(closure)

    watch, (snap,), error = watched(model, dict(SAMPLED, on_nonfinite=policy), loop)
    assert_no_hookprof_sync(watch)
    assert_nan_seen(snap, error, policy)


@pytest.mark.parametrize("kind", ["adam fused", "adam foreach"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradscaler_loop(kind, policy):
    """fp16 autocast + GradScaler: the scaler's own skips (overflowing steps) are no
    incident and cost no wait; GradScaler itself reads found_inf on the host for non-fused
    optimizers, the user's (torch's) wait, not hookprof's."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS[kind](model.parameters())
    overflow = {2, 3}

    def loop():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        g = torch.Generator().manual_seed(0)
        for step in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, model.batch(g))
            if step in overflow:
                loss = loss * 1e38
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    watch, (snap,), error = watched(model, dict(SAMPLED, on_nonfinite=policy), loop)
    assert_no_hookprof_sync(watch)
    assert error is None
    assert snap.skipped_steps == len(overflow)
    assert snap.first_nonfinite is None


def test_detach_mid_run_leaves_nothing_that_waits():
    """detach() in the middle of training (no flush before it), then more steps."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    with lagging_device(LAG), SyncWatch() as watch:
        prof = hookprof.attach(model, **SAMPLED, on_nonfinite="skip")
        plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}), steps=4, user_item=False)()
        prof.detach()
        plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}), steps=3, user_item=False)()
    assert_no_hookprof_sync(watch)
    assert watch.by("user") == []


# -- the one opt-in wait ---------------------------------------------------------------


def documented_waits(watch: SyncWatch) -> list[str]:
    """hookprof's would-syncs as (op, hookprof frame that asked): the innermost frame of a
    wait is transfer.wait_ready, so the caller below it is named."""
    return [
        (
            w.op,
            next(f for f in w.stack if not f.startswith("hookprof/device/transfer.py")).split(":")[
                0
            ],
        )
        for w in watch.hookprofs
    ]


# the replay waits for the output flag of each step until it has run once: steps 1 to 5,
# sampled ones too (issue 28: a sampled step names what its checks saw, and its replay then
# says reproducible or transient, or finds a NaN the root's own code made between layers)
REPLAY_WAITS = BAD_STEP


@pytest.mark.parametrize("kind", ["sgd", "adam fused"])
def test_nonfinite_sync_waits_for_the_output_flag_until_the_producer_is_named(kind):
    """Config.nonfinite_sync under "record": a wait at the optimizer hook for the output
    flag (hookprof/nonfinite/replay.py, through transfer.wait_ready), and nothing else."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS[kind](model.parameters())
    watch, (snap,), _ = watched(
        model,
        dict(SAMPLED, nonfinite_sync=True),
        plain_loop(model, opt, StepInjector(model.blocks[2].fc, {BAD_STEP})),
    )
    assert watch.early_reads == []
    assert (
        documented_waits(watch)
        == [("LaggingEvent.synchronize", "hookprof/nonfinite/replay.py")] * REPLAY_WAITS
    )
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.step) == ("blocks.2.fc", BAD_STEP)


def test_nonfinite_sync_with_a_non_fused_optimizer_under_skip_also_waits_for_the_gradients():
    """Under skip with a non-fused optimizer, the guard waits for the step's flags
    (hookprof/nonfinite/guard.py, through transfer.read_now) at every optimizer pre-hook, and that one
    wait per step is all: it decides before the replay, whose output flag was copied before
    the guard's and so is on the host by then (docs/nonfinite.md, nonfinite_sync)."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    watch, (snap,), _ = watched(
        model,
        dict(SAMPLED, nonfinite_sync=True, on_nonfinite="skip"),
        plain_loop(model, opt, StepInjector(model.blocks[2].fc, {BAD_STEP})),
    )
    assert watch.early_reads == []
    waits = documented_waits(watch)
    guard = waits.count(("LaggingEvent.synchronize", "hookprof/nonfinite/guard.py"))
    assert (guard, len(waits)) == (STEPS, STEPS), watch.report()
    assert snap.held_back_updates == 1
    assert (snap.first_nonfinite.layer, snap.first_nonfinite.step) == ("blocks.2.fc", BAD_STEP)


def test_nonfinite_sync_with_a_fused_optimizer_needs_no_guard_wait():
    """A fused kernel reads the flag on the device: only the replay's wait remains."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS["adamw fused"](model.parameters())
    watch, _, _ = watched(
        model,
        dict(SAMPLED, nonfinite_sync=True, on_nonfinite="skip"),
        plain_loop(model, opt, StepInjector(model.blocks[2].fc, {BAD_STEP})),
    )
    assert (
        documented_waits(watch)
        == [("LaggingEvent.synchronize", "hookprof/nonfinite/replay.py")] * REPLAY_WAITS
    )


# -- the watch can fail ----------------------------------------------------------------


def test_the_watch_catches_a_flag_read_before_its_copy_completed(monkeypatch):
    """A bug put into hookprof: the one-value peek hands back the device flag itself, as a
    copy already complete, so the replay decision at the optimizer hook reads the device
    value (replay.py's bool(flag.host)): a wait on every step of a GPU run."""
    monkeypatch.setattr(transfer, "peek", lambda flag: transfer.Copy(flag, None))
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    watch, _, _ = watched(
        model, dict(SAMPLED), plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}))
    )
    assert watch.hookprofs, "the watch missed a sync put into hookprof"
    frames = {w.frame.split(":")[0] for w in watch.hookprofs}
    assert "hookprof/nonfinite/replay.py" in frames
    assert {w.op for w in watch.hookprofs} == {"aten._local_scalar_dense.default"}


def test_the_watch_catches_device_flags_taken_for_host_values():
    """A bug put into hookprof: every flag taken as readable without waiting (transfer.on_host
    says True on the device), so the optimizer hook's gradient check calls bool() on a device
    flag, as the blocking read found on an H100 did."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS["adam fused"](model.parameters())
    with lagging_device(LAG), SyncWatch() as watch:
        # set over the emulation's own on_host and put back before it restores the original
        # (a monkeypatch would restore the emulation's, "never on the host", after the test)
        emulated, transfer.on_host = transfer.on_host, lambda t: True
        try:
            prof = hookprof.attach(model, **SAMPLED)
            plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}), user_item=False)()
            prof.detach()
        finally:
            transfer.on_host = emulated
    assert watch.hookprofs
    frames = {w.frame.split(" in ")[0].split(":")[0] for w in watch.hookprofs}
    assert "hookprof/nonfinite/detector.py" in frames  # the every-step checks' host reads
    assert watch.by("user") == []


def test_the_watch_catches_a_copy_read_while_still_in_flight(monkeypatch):
    """A bug put into hookprof: every copy taken as complete (transfer.is_ready says True),
    so the policies' flag poll reads host memory the device has not written yet (a wrong
    value on a GPU), and the policy's settle asks the publisher to fold copies still in
    flight (a wait for the device): the watch names both, in hookprof's frames."""
    monkeypatch.setattr(transfer, "is_ready", lambda ready: True)
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    watch, _, _ = watched(
        model,
        dict(SAMPLED, on_nonfinite="skip"),
        plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}), user_item=False),
    )
    assert watch.hookprofs and all(w.op == "Publisher.settle" for w in watch.hookprofs), (
        watch.report()
    )
    frames = {w.frame.split(":")[0] for w in watch.early_reads}
    assert "hookprof/nonfinite/incident.py" in frames, watch.report()


def test_the_users_own_item_is_not_hookprofs():
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    with lagging_device(LAG), SyncWatch() as watch:
        prof = hookprof.attach(model, **SAMPLED)
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, model.batch(g))
            loss.backward()
            opt.step()
            if loss.item() > 1e9:  # the user's wait
                break
        prof.detach()
    assert watch.hookprofs == []
    user = watch.by("user")
    assert [w.op for w in user] == ["aten._local_scalar_dense.default"] * 4
    assert all(" in test_the_users_own_item_is_not_hookprofs" in w.frame for w in user)


def test_waits_inside_flush_are_allowed_and_named():
    """Profiler.flush() may wait; the watch files such waits apart, never as hookprof's."""
    model = seeded(DeepNet)
    opt = OPTIMIZERS["sgd"](model.parameters())
    with lagging_device(LAG), SyncWatch() as watch:
        prof = hookprof.attach(model, **SAMPLED)
        plain_loop(model, opt, StepInjector(model.stem, {BAD_STEP}), user_item=False)()
        ready = transfer.peek(torch.ones(1))[1]  # a copy still in flight
        owner, name = _testing.counter_drain_seam(prof)
        original_drain = getattr(owner, name)

        def drain_and_wait():  # a wait on the training thread inside flush()
            original_drain()
            transfer.wait_ready(ready)

        setattr(owner, name, drain_and_wait)
        prof.flush()
        setattr(owner, name, original_drain)
        prof.detach()
    assert watch.hookprofs == []
    assert [w.op for w in watch.by("flush")] == ["LaggingEvent.synchronize", "Publisher.flush"]


# -- the same on a real GPU ----------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_gradscaler_with_a_fused_optimizer_under_skip_and_raise_on_cuda(policy):
    """The crash the CPU watch found (guard.py, found_inf deleted twice), on a GPU, with no sync
    added: fp16 autocast + GradScaler + fused Adam, overflowing steps skipped by the scaler."""
    torch.manual_seed(0)
    model = DeepNet().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    prof = hookprof.attach(model, **SAMPLED, on_nonfinite=policy)
    g = torch.Generator().manual_seed(0)
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(1, STEPS + 1):
                x, y = (t.cuda(non_blocking=True) for t in (t.pin_memory() for t in model.batch(g)))
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x), y)
                if step in (2, 3):
                    loss = loss * 1e38
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        prof.flush()
        snap = prof.snapshot()
    finally:
        prof.detach()
    assert snap.skipped_steps == 2
    assert snap.first_nonfinite is None


def test_hookprofs_gradscaler_wrapper_is_looked_through_only_for_torchs_own_waits():
    """The wrapper around GradScaler._maybe_opt_step (hookprof/step/gradscaler.py) is looked
    through so that the scaler's own .item() is the user's; a wait the wrapper itself made
    would be hookprof's. Both are run from a function compiled under the wrapper's file and
    name: one reads a value itself, the other calls torch code that reads one
    (clip_grad_norm_ with error_if_nonfinite checks its norm on the host)."""
    import hookprof.step.gradscaler as wrapper_module

    source = (
        "def _maybe_opt_step(own, params):\n"
        "    if own:\n"
        "        return params[0].grad.sum().item()\n"
        "    return torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)\n"
    )
    namespace = {"torch": torch}
    exec(compile(source, wrapper_module.__file__, "exec"), namespace)
    wrapper = namespace["_maybe_opt_step"]
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with SyncWatch() as watch:
        wrapper(True, [p])
    assert [w.frame.split(":")[0] for w in watch.hookprofs] == ["hookprof/step/gradscaler.py"]
    with SyncWatch() as watch:
        wrapper(False, [p])
    assert watch.hookprofs == [] and watch.by("user"), watch.report()
