"""Issue 43 item 5, the rank that two replicas cannot name: on a check step each rank watches
its own parameters from the step's first forward to its update, when nothing may write them
(integrity/replicas.py `hold`/`release`). A bit flipped in a weight inside that window (the
test's own fault, at a known place and time) is counted on this rank, with the parameter; the
loops users write, whose forwards and backwards leave the parameters alone, count nothing.
Across two real DDP ranks and Prometheus: tests/system/test_replica_check_ranks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof.integrity.replicas import ReplicaCheck
from support.metrics import errors_by_part, parse, scrape

# a tiny interval: every step after the first is a check step, so the test's fault lands in
# a watched window at the step it chooses
EVERY_STEP = 1e-9
FLIP_STEP = 7


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 1))


def flip(weight: torch.Tensor, element=(0, 0), bit: int = 20) -> None:
    """One bit of `weight` flipped as a device's memory would: through `.data`, which leaves
    autograd's version counter alone (a tensor the backward saved is not "modified")."""
    weight.data.view(torch.int32)[element] ^= 1 << bit


def train(model, prof, steps: int, during=None, between=None, in_backward=False) -> None:
    """A plain loop; `during(step)` runs inside the forward (a forward hook on the model's
    last layer), or inside the backward with `in_backward` (a full backward hook on it), until
    it returns true once; `between(step)` runs after the update."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    step = [0]

    done = []  # a fault strikes once (the replay check runs the forward again: not again)

    def hook(*_):  # (returns None: the output and gradients stay as they are)
        if not done and during(step[0]):
            done.append(step[0])

    handle = None
    if during is not None:
        register = model[-1].register_full_backward_hook if in_backward else None
        register = register or model[-1].register_forward_hook
        handle = register(hook)
    try:
        for step[0] in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            prof.step()
            if between is not None:
                between(step[0])
    finally:
        if handle is not None:
            handle.remove()


def lbfgs_steps(model, prof, steps: int) -> None:
    """A closure optimizer's steps: the forward runs inside optimizer.step()."""
    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = torch.randn(4, 8)

    def closure():
        lbfgs.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(steps):
        lbfgs.step(closure)
        prof.step()


def watched(model, steps: int = 12, **kwargs):
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        train(model, prof, steps, **kwargs)
        prof.flush()
        return prof.snapshot(), parse(scrape(prof.url))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_bit_flipped_between_the_forward_and_the_update_is_counted_with_its_parameter(where):
    model = small_model()
    target = model[0].weight  # not the layer the fault's hook is on
    snap, page = watched(
        model,
        during=lambda s: s == FLIP_STEP and not flip(target),
        in_backward=where == "backward",
    )
    assert snap.parameter_changes == 1
    change = snap.parameter_change
    assert (change.step, change.parameter, change.changed) == (FLIP_STEP, "0.weight", 1)
    [total] = page["hookprof_parameter_changes_outside_update"].samples
    assert total.value == 1.0
    # the replay check, on the same step, ran the forward again on the changed weight: the
    # machine too, the first layer that reads it named
    assert snap.replay_mismatch is not None
    assert (snap.replay_mismatch.step, snap.replay_mismatch.layer) == (FLIP_STEP, "0")
    [info] = page["hookprof_parameter_change_info"].samples
    assert dict(info.labels) == {
        "model": "Sequential",
        "rank": "0",
        "parameter": "0.weight",
        "step": str(FLIP_STEP),
        "changed": "1",
    }


def test_the_first_parameter_in_the_models_order_is_named_and_all_are_counted():
    model = small_model()

    def during(step):
        if step == FLIP_STEP:
            flip(model[3].bias, (0,), 3)
            flip(model[2].weight, (5,), 30)
            return True

    snap, _ = watched(model, during=during)
    change = snap.parameter_change
    assert (change.parameter, change.changed, snap.parameter_changes) == ("2.weight", 2, 1)


def test_a_flip_between_an_update_and_the_next_forward_is_outside_the_window():
    """Where the loop's own clamps and loads belong: not watched (docs/integrity.md). The
    fingerprint still carries it to the replicas' comparison."""
    model = small_model()
    snap, page = watched(model, between=lambda s: s == FLIP_STEP and flip(model[0].weight))
    assert snap.parameter_changes == 0 and snap.parameter_change is None
    [total] = page["hookprof_parameter_changes_outside_update"].samples
    assert total.value == 0.0  # exported from 0 while the check is on
    assert "hookprof_parameter_change_info" not in page


@pytest.mark.parametrize("through", ["in-place", ".data"])
def test_a_perturbation_undone_inexactly_is_the_programs_where_torch_sees_it(through):
    """A sharpness-aware step's perturbation, added after the backward and taken off before
    the update, does not always give the same bits back. Written with in-place ops (which
    move the parameters' version counters) it is the program's, never counted; written
    through `.data` (which torch does not see) it is counted, and `changed` says it touched
    many parameters, not one."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    inexact = []
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            before = [p.detach().clone() for p in params]
            with torch.no_grad():  # the perturbation, then taken off, before the update
                for p in params:
                    t = p if through == "in-place" else p.data
                    t.add_(torch.full_like(p, 1e-3 / 3)).sub_(torch.full_like(p, 1e-3 / 3))
            inexact.append(sum(not torch.equal(b, p) for b, p in zip(before, params)))
            opt.step()
            prof.step()
        prof.flush()
        snap = prof.snapshot()
    checked = inexact[1:]  # (the first step only starts the check's clock)
    assert any(checked)  # (else the test tells nothing)
    if through == "in-place":
        assert snap.parameter_changes == 0 and snap.parameter_change is None
        return
    assert snap.parameter_changes == sum(1 for n in checked if n)
    last = [n for n in checked if n][-1]  # (the last change is the one kept)
    assert snap.parameter_change is not None and snap.parameter_change.changed == last


class EmbedBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8, max_norm=1.0)  # renormalises its rows in the forward
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def test_loops_that_leave_parameters_alone_count_nothing():
    """A clamp after the update (WGAN), BatchNorm, gradient accumulation, two optimizers,
    GradScaler on the CPU, a closure optimizer, and an embedding with max_norm: no change."""
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    embed = EmbedBag()
    cases = {"clamp": small_model(), "batchnorm": bn, "embedding": embed}
    for name, model in cases.items():
        with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(2)
            for _ in range(10):
                opt.zero_grad()
                for _ in range(2):  # two micro-batches
                    if name == "embedding":
                        x = torch.randint(0, 50, (4, 3), generator=g)
                    else:
                        x = torch.randn(4, 8, generator=g)
                    model(x).square().mean().backward()
                opt.step()
                if name == "clamp":
                    with torch.no_grad():
                        for p in model.parameters():
                            p.clamp_(-0.05, 0.05)
                prof.step()
            prof.flush()
            snap = prof.snapshot()
        assert snap.parameter_changes == 0, name
        assert snap.parameter_fingerprint is not None and snap.parameter_fingerprint.step > 1

    # two optimizers in a step (a GAN's), GradScaler, and LBFGS's closure
    gan = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with hookprof.attach(gan, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        first = torch.optim.SGD(gan[0].parameters(), lr=1e-2)
        second = torch.optim.SGD(gan[2].parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(10):
            gan(torch.randn(4, 8)).square().mean().backward()
            scaler.scale(gan(torch.randn(4, 8)).square().mean()).backward()
            first.step()
            scaler.step(second)
            scaler.update()
            first.zero_grad()
            second.zero_grad()
            prof.step()
        lbfgs_steps(gan, prof, 5)
        prof.flush()
        snap = prof.snapshot()
    assert snap.parameter_changes == 0


def test_a_fault_in_the_watch_costs_the_check_alone(monkeypatch):
    def broken(self):
        raise RuntimeError("injected into the watch")

    monkeypatch.setattr(ReplicaCheck, "hold", broken)
    model = small_model()
    snap, page = watched(model, during=lambda s: s == FLIP_STEP and not flip(model[0].weight))
    assert snap.step == 12 and snap.parameter_changes == 0
    assert snap.parameter_fingerprint is not None  # the replicas' fingerprint goes on
    errors = errors_by_part(page)
    assert errors["integrity"] >= 1
    assert all(n == 0 for part, n in errors.items() if part != "integrity")


class MomentumEncoder(nn.Module):
    """MoCo's pattern: a key encoder, updated inside the forward (`param.data = ...`, under
    no_grad) as a moving average of the query encoder; it never trains. `in_place`: the
    same update written into `.data` in place (no new data, no version counter moved)."""

    def __init__(self, in_place: bool = False):
        super().__init__()
        self.in_place = in_place
        self.q = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.k = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.k.load_state_dict(self.q.state_dict())
        for p in self.k.parameters():
            p.requires_grad = False

    def forward(self, x):
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                if self.in_place:
                    pk.data.mul_(0.99).add_(pq.data * 0.01)
                else:
                    pk.data = pk.data * 0.99 + pq.data * 0.01
            keys = self.k(x)
        return (self.q(x) * keys).sum(1)


def test_a_momentum_encoder_updated_in_the_forward_is_neither_a_change_nor_replayed():
    """Found in review: MoCo's key encoder is written by the forward itself. It never trains,
    so the watch leaves it out; the replay check would update it a second time, so it is not
    run (not_compared, with the reason), and training is the same, bit for bit, as without
    hookprof."""

    def losses(attach: bool):
        torch.manual_seed(0)
        model = MomentumEncoder()
        opt = torch.optim.SGD(model.q.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(3)
        out = []
        prof = hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) if attach else None
        try:
            for _ in range(12):
                opt.zero_grad()
                loss = model(torch.randn(4, 8, generator=g)).square().mean()
                loss.backward()
                opt.step()
                out.append(loss.detach().clone())
                if prof is not None:
                    prof.step()
            if prof is None:
                return out, None
            prof.flush()
            return out, prof.snapshot()
        finally:
            if prof is not None:
                prof.detach()

    bare, _ = losses(False)
    watched_losses, snap = losses(True)
    assert all(torch.equal(a, b) for a, b in zip(bare, watched_losses))
    assert snap.parameter_changes == 0 and snap.parameter_watches["compared"] == 11
    assert snap.replay_checks["not_reproduced"] == 0
    assert snap.replay_checks["not_compared"] == 11


def test_a_momentum_encoder_written_in_place_through_data_is_not_watched():
    """The same update written into `.data` in place moves nothing torch sees: the watch
    leaves the encoder out as it never trains (the replay check cannot tell: docs/integrity.md)."""
    torch.manual_seed(0)
    model = MomentumEncoder(in_place=True)
    opt = torch.optim.SGD(model.q.parameters(), lr=0.05)
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            prof.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.parameter_changes == 0 and snap.parameter_watches["compared"] == 7


def test_a_gan_whose_steps_end_at_the_optimizers_clamps_outside_the_window():
    """Found in review: WGAN's loop with the critic attached and no prof.step(). The critic's
    forward in the generator's phase begins hookprof's next step; the next critic iteration
    clamps the critic's weights before its own forward. The generator's update (an optimizer
    that does not own the critic) starts the window again, so the clamp is outside it."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    generator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
    opt_c = torch.optim.RMSprop(critic.parameters(), lr=5e-3)
    opt_g = torch.optim.RMSprop(generator.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(critic, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        for _ in range(8):
            for _ in range(3):  # critic iterations, weights clipped first
                with torch.no_grad():
                    for p in critic.parameters():
                        p.data.clamp_(-0.05, 0.05)
                real = torch.randn(8, 4, generator=g)
                fake = generator(torch.randn(8, 2, generator=g)).detach()
                opt_c.zero_grad()
                (critic(fake).mean() - critic(real).mean()).backward()
                opt_c.step()
            opt_g.zero_grad()
            (-critic(generator(torch.randn(8, 2, generator=g))).mean()).backward()
            opt_g.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.parameter_watches["compared"] >= 10
    assert snap.parameter_changes == 0, snap.parameter_change


def test_where_nothing_can_be_watched_it_says_so():
    """A compiled model's forward (the root hooks run while Dynamo traces only) and a closure
    optimizer's (its forward runs inside its step): counted not_compared, never a silent 0."""
    torch.manual_seed(0)
    model = small_model()
    with hookprof.attach(model, port=0, sdc_check_interval_s=EVERY_STEP) as prof:
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for _ in range(6):
            opt.zero_grad()
            compiled(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            prof.step()
        lbfgs_steps(model, prof, 4)
        prof.flush()
        snap = prof.snapshot()
        page = parse(scrape(prof.url))
    watches = snap.parameter_watches
    assert watches["compared"] == 0 and watches["not_compared"] == snap.step - 1
    assert {s.labels["result"]: s.value for s in page["hookprof_parameter_watches"].samples} == {
        "compared": 0.0,
        "not_compared": float(snap.step - 1),
    }
