"""DESIGN.md invariants 3, 4 and 10 across threads: models attached, trained and detached on
threads of their own, and detach() from another thread, never break a training loop; after
detach nothing of hookprof runs or listens again.

torch's optimizer step iterates its process-wide hook dicts without a lock: a profiler that
added or removed a hook there while another thread's optimizer stepped made that step raise
"OrderedDict mutated during iteration" in the user's loop (step/dispatch.py)."""

from __future__ import annotations

import random
import socket
import threading
import time

import torch
from torch import nn

import hookprof
from support.hooks_left import hookprof_threads

QUIET = dict(
    sample_every=1000, min_sample_interval_s=0.0, summary_at_exit=False, system_metrics=False
)


def _tiny(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x = torch.ones(2, 4)
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def test_models_attached_trained_and_detached_on_two_threads():
    errors: list[BaseException] = []
    trials = 150  # per thread: 300 attach/train/detach cycles in all

    def worker(seed: int) -> None:
        model, opt = _tiny(seed)
        for _ in range(trials):
            try:
                prof = hookprof.attach(model, serve=False, stall_detection=False, **QUIET)
                _train(model, opt, 3)
                prof.detach()
            except BaseException as exc:  # what reached the user's loop
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        # a bound against a deadlock, not a timing: the 300 cycles take ~45 s on 2 idle
        # cores (each attach counts step 1's FLOPs), and the full suite ran it past 60 s
        t.join(timeout=240.0)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert hookprof_threads() == []


def _refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_detach_from_another_thread_while_training():
    rng = random.Random(29)
    for trial in range(30):
        model, opt = _tiny(trial)
        prof = hookprof.attach(model, port=0, **QUIET)
        port = prof.port
        errors: list[BaseException] = []
        detached = threading.Event()

        def loop() -> None:
            try:
                deadline = time.monotonic() + 10.0
                while not detached.is_set() and time.monotonic() < deadline:
                    _train(model, opt, 1)
                _train(model, opt, 5)  # its next steps, after detach
            except BaseException as exc:  # what reached the user's loop
                errors.append(exc)

        trainer = threading.Thread(target=loop)
        trainer.start()
        time.sleep(rng.uniform(0.0, 0.02))
        prof.detach()
        detached.set()
        trainer.join(timeout=15.0)
        assert not trainer.is_alive()
        assert errors == [], f"trial {trial}"
        assert prof.detached
        assert hookprof_threads() == [], f"trial {trial}"
        assert _refuses(port), f"trial {trial}: port {port} still listening"


def test_detach_from_another_thread_during_a_step_end_leaves_no_layer_hooks(monkeypatch):
    """detach() on another thread while the training thread is inside a step's end, between
    the step's check for detach and the planning of the next sampled step (which puts the
    layer hooks in): the step end is held there until detach has finished, or for 3 s if
    detach waits for it. Before the fix, detach finished, then the step end put the forward
    wrappers back on every layer, for good."""
    from hookprof import _testing
    from support.hooks_left import forward_hooks, forward_pre_hooks

    owner, name = _testing.step_end_seam()
    original = getattr(owner, name)
    inside, detach_done = threading.Event(), threading.Event()
    held = []

    def held_step_end(self, step):
        if step == 3 and not held:
            held.append(step)
            inside.set()
            detach_done.wait(3.0)
        return original(self, step)

    monkeypatch.setattr(owner, name, held_step_end)
    model, opt = _tiny(0)
    prof = hookprof.attach(
        model,
        port=0,
        sample_every=1,
        min_sample_interval_s=0.0,
        summary_at_exit=False,
        system_metrics=False,
    )
    trainer = threading.Thread(target=_train, args=(model, opt, 3))
    trainer.start()
    assert inside.wait(30.0)

    def detach() -> None:
        prof.detach()
        detach_done.set()

    detacher = threading.Thread(target=detach)
    detacher.start()
    detacher.join(30.0)
    trainer.join(30.0)
    assert not detacher.is_alive() and not trainer.is_alive() and prof.detached
    left = [
        (n, sorted(vars(m)))
        for n, m in model.named_modules()
        if "forward" in vars(m) or forward_hooks(m) or forward_pre_hooks(m)
    ]
    assert left == []
    _train(model, opt, 2)  # and it trains on, unprofiled
