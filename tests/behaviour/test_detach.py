"""DESIGN.md invariant 4: detach() restores the model exactly and frees the port."""

from __future__ import annotations

import threading

import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals
from torch.amp.grad_scaler import GradScaler

import hookprof
from conftest import port_is_free, free_port, scrape
from models import MixedNet, seeded, train

GLOBAL_HOOK_DICTS = [
    module_globals._global_forward_hooks,
    module_globals._global_forward_pre_hooks,
    module_globals._global_backward_hooks,
    module_globals._global_backward_pre_hooks,
    optimizer_globals._global_optimizer_pre_hooks,
    optimizer_globals._global_optimizer_post_hooks,
]
MODULE_HOOK_DICTS = [
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
]


def model_state(model: torch.nn.Module) -> dict:
    """Everything hookprof could leave behind on a model: attribute names, hook dicts,
    parameter hooks."""
    state = {}
    for name, m in model.named_modules():
        state[name] = {
            "attrs": sorted(vars(m)),
            **{d: len(getattr(m, d)) for d in MODULE_HOOK_DICTS},
        }
    for name, p in model.named_parameters():
        state["param:" + name] = (
            len(p._post_accumulate_grad_hooks or {}),
            len(p._backward_hooks or {}),
            sorted(vars(p)),
        )
    return state


def hookprof_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hookprof")]


def test_detach_leaves_nothing_behind():
    model = seeded(MixedNet)
    before = model_state(model)
    globals_before = [len(d) for d in GLOBAL_HOOK_DICTS]
    scaler_decides = GradScaler._maybe_opt_step
    port = free_port()
    prof = hookprof.attach(model, port=port, sample_every=2, min_sample_interval_s=0.0)
    assert not port_is_free(port)
    assert [len(d) for d in GLOBAL_HOOK_DICTS] != globals_before
    assert GradScaler._maybe_opt_step is not scaler_decides  # watched while attached
    assert hookprof_threads()
    train(model, 5)  # ends on an unsampled step ...
    model(model.batch(torch.Generator())[0])  # ... and a sampled one left half-done
    prof.detach()

    assert model_state(model) == before
    assert [len(d) for d in GLOBAL_HOOK_DICTS] == globals_before
    assert GradScaler._maybe_opt_step is scaler_decides  # torch's own method again
    assert port_is_free(port)
    assert hookprof_threads() == []
    assert prof.detached
    prof.detach()  # idempotent

    # attaching again works, on the same port
    with hookprof.attach(model, port=port) as again:
        train(model, 2)
        again.flush()
        assert again.snapshot().step == 2
        assert 'hookprof_steps_total{model="MixedNet",rank="0"} 2.0' in scrape(again.url)
    assert model_state(model) == before


def test_context_manager_detaches_on_error():
    model = seeded(MixedNet)
    before = model_state(model)
    try:
        with hookprof.attach(model, port=0):
            raise KeyError("boom")
    except KeyError:
        pass
    assert model_state(model) == before
    assert hookprof_threads() == []


def test_snapshot_still_readable_after_detach():
    model = seeded(MixedNet)
    prof = hookprof.attach(model, port=0)
    train(model, 3)
    prof.detach()
    assert prof.snapshot().step == 3  # detach publishes the final state
