"""torch.jit.trace (what SummaryWriter.add_graph does) and torch.export of an attached model
work, and never latch the eager run into "compiled" (issue 29, item 4): hookprof steps
aside while the model is traced."""

from __future__ import annotations

import logging

import torch
from torch import nn

import hookprof
from support.settings import EVERY_STEP


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(model, opt, x, y, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _forward_calls(prof) -> int:
    prof.flush()
    return sum(layer.forward_calls_total for layer in prof.snapshot().layers.values())


def test_jit_trace_in_train_mode_of_an_attached_model():
    model = _mlp()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.attach(model, **EVERY_STEP, serve=False)
    try:
        _train(model, opt, x, y, 3)  # a sampled step's wrappers are in while it traces
        traced = torch.jit.trace(model, (x,))  # its default check_trace runs it twice
        with torch.no_grad():
            assert torch.equal(traced(x), model(x))
        _train(model, opt, x, y, 2)
        assert _forward_calls(prof) == 5 * 3  # every sampled step, none of the trace's calls
        assert prof.snapshot().internal_errors == 0
    finally:
        prof.detach()


def test_export_in_eval_mode_then_eager_training_keeps_layer_timing(caplog):
    model = _mlp()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = hookprof.attach(model, **EVERY_STEP, serve=False)
    try:
        with caplog.at_level(logging.INFO, logger="hookprof"):
            _train(model, opt, x, y, 3)
            before = _forward_calls(prof)
            model.eval()
            exported = torch.export.export(model, (x,))
            model.train()
            seen = []
            for _ in range(3):
                _train(model, opt, x, y, 1)
                seen.append(_forward_calls(prof))
        with torch.no_grad():
            model.eval()
            assert torch.allclose(exported.module()(x), model(x))
    finally:
        prof.detach()
    assert before == 9
    assert seen == [12, 15, 18]  # per-layer forward calls go on being recorded
    assert "torch.compile" not in caplog.text
