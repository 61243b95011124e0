"""Layers whose backward goes wrong once when armed: the tests' stand-ins for a device that
computes one backward kernel wrongly (tests/behaviour/test_spike_replay_backward.py,
test_jump_step_replay.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class _WrongGradient(torch.autograd.Function):
    """Identity forward; its backward makes one gradient row wrong when armed (the test's
    stand-in for a device that computes one backward kernel wrongly, once)."""

    armed = {"now": False}

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _WrongGradient.armed["now"]:
            _WrongGradient.armed["now"] = False
            grad = grad.clone()
            grad[0] = grad[0] * 100 + 5
        return grad


class BackwardFaultLinear(nn.Linear):
    """A Linear whose backward, armed, makes the gradient of its input wrong."""

    def forward(self, x):
        return super().forward(_WrongGradient.apply(x))


class _WrongWeightGradient(torch.autograd.Function):
    """A linear layer whose backward, armed, makes one row of its weight's gradient wrong and
    nothing else (the test's stand-in for a device whose weight-gradient GEMM goes wrong
    once: the layers' output gradients, which the backward passes on, stay right)."""

    armed = {"now": False}

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight = grad.t() @ x
        if _WrongWeightGradient.armed["now"]:
            _WrongWeightGradient.armed["now"] = False
            grad_weight[0] = grad_weight[0] * 100 + 5
        return grad @ weight, grad_weight, grad.sum(0)


class WeightFaultLinear(nn.Linear):
    def forward(self, x):
        return _WrongWeightGradient.apply(x, self.weight, self.bias)


class Net(nn.Module):
    """fc1 -> act -> fc2 -> act2 -> head; fc2's backward can go wrong (BackwardFaultLinear)."""

    def __init__(self, checkpointed: bool = False, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.act = nn.Linear(8, 16), nn.ReLU()
        self.fc2, self.act2 = BackwardFaultLinear(16, 16), nn.Tanh()
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 1)
        self.checkpointed = checkpointed

    def _middle(self, h):
        return self.act2(self.fc2(h))

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.checkpointed:
            h = checkpoint(self._middle, h, use_reentrant=False)
        else:
            h = self._middle(h)
        return self.head(self.drop(h))


class WeightFaultNet(Net):
    """Net whose fc2 can compute its weight's gradient wrongly (WeightFaultLinear)."""

    def __init__(self):
        super().__init__()
        self.fc2 = WeightFaultLinear(16, 16)
