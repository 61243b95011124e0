"""Layers are timed through a wrapper set as their `forward` attribute on sampled steps: it
must behave like the module's own forward to everything that looks at it."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import weakref

import torch
from torch import nn

import hookprof
from support.models import DeepNet, seeded, train


def test_copies_of_an_instrumented_layer_run_their_own_parameters(every_step):
    model = seeded(DeepNet)
    layer = model.blocks[0].fc
    with hookprof.attach(model, **every_step):
        train(model, 2)  # every step sampled: the wrapper is on between steps too
        assert "forward" in vars(layer)
        x = torch.randn(3, layer.in_features)
        expected = torch.ones(3, layer.out_features)  # what zero weights and unit biases give

        buffer = io.BytesIO()
        torch.save(layer, buffer)  # whole-module pickling (checkpoints, EMA copies)
        buffer.seek(0)
        copies = [copy.deepcopy(layer), torch.load(buffer, weights_only=False)]
        for c in copies:
            with torch.no_grad():
                c.weight.zero_()
                c.bias.fill_(1.0)
            torch.testing.assert_close(c(x), expected, rtol=0, atol=0)
        assert not torch.equal(layer(x), expected)  # the original is untouched

        own = nn.Linear.forward.__get__(layer)
        assert inspect.signature(layer.forward) == inspect.signature(own)
    assert "forward" not in vars(layer)


def test_a_forward_attribute_of_the_users_own_is_restored(every_step):
    model = seeded(DeepNet)
    layer = model.blocks[0].fc
    calls = []
    original = layer.forward

    def counting_forward(x):
        calls.append(1)
        return original(x)

    layer.forward = counting_forward
    with hookprof.attach(model, **every_step) as prof:
        train(model, 3)
        prof.flush()
        snap = prof.snapshot()
    assert vars(layer)["forward"] is counting_forward
    assert len(calls) == 3  # the user's forward ran once per step, inside hookprof's wrapper
    assert snap.layers["blocks.0.fc"].forward_calls_total == 3


def test_copies_of_the_attached_model_train_unprofiled(every_step):
    """EMA/SWA copies (deepcopy) and whole-model checkpoints (pickle) made between steps:
    the copies run their own parameters and their copied root hooks do nothing."""
    model = seeded(DeepNet)
    with hookprof.attach(model, **every_step) as prof:
        train(model, 2)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies = [
            copy.deepcopy(model),
            torch.optim.swa_utils.AveragedModel(model).module,
            torch.load(buffer, weights_only=False),
        ]
        x = torch.randn(4, 8)
        with torch.no_grad():  # an evaluation call of the original: not profiled
            reference = model(x)
        for c in copies:
            torch.testing.assert_close(c(x), reference, rtol=0, atol=0)
            train(c, 2)  # the copy's own optimizer: hookprof's global hooks ignore it
            with torch.no_grad():
                for p in c.parameters():
                    p.zero_()
            assert torch.equal(c(x), torch.zeros(4, 1))
        train(model, 1)
        prof.flush()
        snap = prof.snapshot()
        # neither the copies' forwards nor their optimizer steps were profiled
        assert snap.step == 3
        assert snap.layers["stem"].forward_calls_total == 3


class _Token:
    pass


class _Keep(torch.autograd.Function):
    """Identity whose autograd node holds a token: the token lives exactly as long as the
    node (and so the graph) does."""

    @staticmethod
    def forward(ctx, x, token):
        ctx.token = token
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = []
        self.check = False
        self.earlier_graph_alive = None

    def forward(self, x):
        if self.check:  # is the graph of the previous forward still alive, mid-forward?
            gc.collect()
            self.earlier_graph_alive = self.tokens[-1]() is not None
        token = _Token()
        self.tokens.append(weakref.ref(token))
        return _Keep.apply(x, token)


class _FailingHead(nn.Linear):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return super().forward(x)


def test_a_forward_that_raises_leaves_no_graph_alive(every_step):
    """An out-of-memory retry loop: the graph of the forward that raised must be freed before
    the retry runs, although hookprof noted its nodes for backward marks."""
    probe, head = _Probe(), _FailingHead(4, 1)
    model = nn.Sequential(nn.Linear(4, 4), probe, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookprof.attach(model, **every_step) as prof:
        for step in range(3):
            head.fail = step == 1
            failed = False
            try:
                loss = model(torch.randn(8, 4)).square().mean()
            except RuntimeError:
                failed = True  # (the traceback keeps the failed frames alive in here)
            if failed:
                head.fail, probe.check = False, True
                loss = model(torch.randn(8, 4)).square().mean()  # the retry
                probe.check = False
                assert probe.earlier_graph_alive is False, "the failed forward's graph lived on"
            opt.zero_grad()
            loss.backward()
            opt.step()
        prof.flush()
        snap = prof.snapshot()
    assert snap.step == 3
    assert snap.layers["1"].backward_calls_total == 3  # marks of the retried step still work
