"""Plain loops that break a step view built on the root's forward and the optimizer's
pre-hook (issue 18; DESIGN.md invariant 7): optimizers stepped with a closure that runs the
forward and backward inside `optimizer.step`, a model whose loop never calls the root
module, and several models in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookprof
from hookprof._testing import hook_owner
from support.hooks_left import forward_pre_hooks
from support.metrics import parse, samples, scrape
from support.models import (
    DeepNet,
    Discriminator,
    Generator,
    hookprof_norms,
    layer_norms,
    loss_of,
    seeded,
    train,
)
from support.ports import free_port
from support.settings import EVERY_STEP


def closure_run(model, opt, steps: int, prof):
    """`opt.step(closure)` for `steps` steps, the closure doing zero_grad, forward and
    backward. Returns, per step, the norms after the closure's last backward (the gradients
    the update reads), how often the closure ran, and hookprof's view after the step."""
    g = torch.Generator().manual_seed(0)
    expected, calls, seen = [], [], []
    for _ in range(steps):
        batch = model.batch(g)
        last: list[dict[str, float]] = []

        def closure():
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, batch)
            loss.backward()
            last.append(layer_norms(model))
            return loss

        opt.step(closure)
        expected.append(last[-1])
        calls.append(len(last))
        seen.append(hookprof_norms(prof))
    return expected, calls, seen


def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.1, max_iter=4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# issue 18 (1): step 1 showed no norms (read at the pre-hook, before the closure's
# backward, while .grad was still None)
@pytest.mark.parametrize("make_opt", [lbfgs, sgd], ids=["lbfgs", "sgd-closure"])
def test_closure_steps_report_the_norms_of_the_closures_last_backward(make_opt):
    steps = 5
    model = seeded(DeepNet)
    with hookprof.attach(model, **EVERY_STEP) as prof:
        expected, calls, seen = closure_run(model, make_opt(model.parameters()), steps, prof)
    if make_opt is lbfgs:
        assert max(calls) > 1  # LBFGS re-evaluates: only the last backward counts
    for step, ((counted, sampled, norms), want) in enumerate(zip(seen, expected), 1):
        assert (counted, sampled) == (step, step), f"step {step}"
        assert norms == pytest.approx(want, rel=1e-5), f"step {step}"


class LossMethodNet(nn.Module):
    """A model whose training loop calls `compute_loss`, never the module itself (it has no
    forward): hookprof sees no root forward at all."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.head = nn.Linear(16, 1)

    def compute_loss(self, x, y):
        return nn.functional.mse_loss(self.head(self.act(self.stem(x))), y)


# issue 18 (2), before entry calls: with both settings nonfinite_steps == {"forward": 0,
# "backward": 2, "loss": 0} and first_nonfinite == ("head", "backward", 5): no root forward,
# so no forward check and no producer. Now the first call of a root's child from outside the
# model (here `stem`) is the step's forward: its inputs and output are checked
@pytest.mark.parametrize(
    "settings",
    [EVERY_STEP, dict(EVERY_STEP, activation_interval_s=0.0)],
    ids=["issue-settings", "every-step-checked"],
)
def test_nan_in_the_batch_of_a_loop_that_never_calls_the_root(settings):
    model = seeded(LossMethodNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with hookprof.attach(model, **settings) as prof:
        for step in range(1, 7):
            x = torch.randn(16, 8, generator=g)
            y = x.sum(dim=1, keepdim=True)
            if step == 5:
                x[3, 2] = float("nan")  # bad data, not a bad layer
            opt.zero_grad(set_to_none=True)
            model.compute_loss(x, y).backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 6
    event = snap.first_nonfinite
    assert event is not None
    assert (event.layer, event.phase, event.step) == ("(input)", "forward", 5)
    assert snap.nonfinite_steps["forward"] >= 1


# ---- several models in one process ------------------------------------------------------


def gan_steps(gen, disc, iterations: int, critic_steps: int) -> None:
    """A small GAN loop: `critic_steps` discriminator steps, then one generator step."""
    g = torch.Generator().manual_seed(0)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(iterations):
        for _ in range(critic_steps):
            real = torch.randn(16, 8, generator=g) + 2.0
            fake = gen(torch.randn(16, 4, generator=g)).detach()
            loss_d = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake), torch.zeros(16, 1))
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
        loss_g = bce(disc(gen(torch.randn(16, 4, generator=g))), torch.ones(16, 1))
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()


def steps_by_model(text: str) -> dict[str, float]:
    exported = samples(parse(text), "hookprof_steps", "hookprof_steps_total", model=None)
    return {dict(labels).get("model"): value for labels, value in exported.items()}


# issue 18 (3): the second attach raised PortInUseError (each profiler bound the configured
# port for itself) and no series carried a model label
def test_a_gan_attached_twice_with_default_ports_serves_both_from_one_endpoint(monkeypatch):
    # the default port, given no port at attach; taken from the environment only so that
    # another test run on this machine cannot hold it
    monkeypatch.setenv("HOOKPROF_PORT", str(free_port()))
    gen, disc = seeded(Generator), seeded(Discriminator)
    with hookprof.attach(gen) as prof_g, hookprof.attach(disc) as prof_d:
        gan_steps(gen, disc, iterations=3, critic_steps=2)
        prof_g.flush()
        prof_d.flush()
        assert prof_g.url == prof_d.url  # the endpoint belongs to the process
        text = scrape(prof_g.url)
    # the model label: a name given at attach, by default the class name
    assert steps_by_model(text) == {"Generator": 3, "Discriminator": 6}
    norms = samples(parse(text), "hookprof_layer_gradient_norm", model=None)
    layers = {(dict(labels)["model"], dict(labels)["layer"]) for labels in norms}
    assert layers == {
        ("Generator", "net.0"),
        ("Generator", "net.2"),
        ("Discriminator", "net.0"),
        ("Discriminator", "net.2"),
    }


# issue 18 (3): PortInUseError at the second attach, as above
def test_two_models_of_one_class_get_distinct_model_labels(monkeypatch):
    monkeypatch.setenv("HOOKPROF_PORT", str(free_port()))
    first, second = seeded(DeepNet), seeded(DeepNet, seed=1)
    with hookprof.attach(first) as prof_a, hookprof.attach(second) as prof_b:
        for model, steps in ((first, 2), (second, 1)):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(0)
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                loss_of(model, model.batch(g)).backward()
                opt.step()
        prof_a.flush()
        prof_b.flush()
        counts = steps_by_model(scrape(prof_a.url))
    # by default the class name, made unique: the first keeps it, the second gets another
    assert counts["DeepNet"] == 2
    (other,) = set(counts) - {"DeepNet"}
    assert other.startswith("DeepNet") and counts[other] == 1


def test_detaching_one_model_leaves_the_others_served_and_the_last_frees_the_port():
    import socket

    port = free_port()
    gen, disc = seeded(Generator), seeded(Discriminator)
    prof_g = hookprof.attach(gen, port=port)
    prof_d = hookprof.attach(disc, port=port)
    try:
        gan_steps(gen, disc, iterations=2, critic_steps=1)
        prof_d.detach()
        prof_g.flush()
        counts = steps_by_model(scrape(prof_g.url))
        assert counts == {"Generator": 2}  # D's series are gone, G's still served
    finally:
        prof_g.detach()
        prof_d.detach()
    with pytest.raises(ConnectionRefusedError):  # the last model out closed the endpoint
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_entry_calls_end_at_the_roots_first_training_forward_and_spare_copies():
    """The entry hooks (on the root's children) serve loops that never call the root; a
    copy made while they are on (an EMA copy at step 0) trains unprofiled, and the first
    training forward of the root itself removes them."""
    import copy

    model = seeded(LossMethodNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with hookprof.attach(model, **EVERY_STEP) as prof:
        ema = copy.deepcopy(model)  # holds nothing of hookprof (step/copies.py)
        ema.compute_loss(x, y).backward()  # nothing happens in hookprof, nothing raises
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model.compute_loss(x, y).backward()
            opt.step()
        assert all(entry_hooked(m, prof) for m in model.children())
        assert not any(entry_hooked(m, prof) for m in ema.children())  # the copy has none
        prof.flush()
        assert prof.snapshot().step == 2 and prof.snapshot().internal_errors == 0
    assert not any(entry_hooked(m, prof) for m in model.children())  # detach: gone

    deep = seeded(DeepNet)  # a model trained through its root forward
    with hookprof.attach(deep, **EVERY_STEP) as prof:
        assert all(entry_hooked(m, prof) for m in deep.children())
        with torch.no_grad():
            deep(deep.batch(torch.Generator())[0])  # an evaluation pass changes nothing
        assert all(entry_hooked(m, prof) for m in deep.children())
        train(deep, 1)
        assert not any(entry_hooked(m, prof) for m in deep.children())


def entry_hooked(module, prof) -> bool:
    return any(getattr(h, "__self__", None) is hook_owner(prof) for h in forward_pre_hooks(module))
