"""What one sampled step costs per instrumented leaf, counted, not timed: timer marks (CUDA
event records on a GPU, ~3 us of host time each on an H100) and Python calls into hookprof's
hooks, with the CUDA event timer over stand-in events (there is no GPU here).

The design's promise, per layer call on a sampled step: two forward marks (start, end),
two more only around a call with an instrumented parent; one mark per autograd node that
carries a gradient between layers (a layer's output node is the next layer's input node:
one mark serves both); one mark per parameter only for layers whose inputs need no
gradient (their backward ends at their parameters' accumulation). So a chain of N layers
costs 3N marks plus the first layer's parameters, whatever their width."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.mark_counter import count_sampled_step


def step_of(model: nn.Module, x: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(before_update):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        before_update(model)
        opt.step()

    return step


def linear_chain(n: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(n)])


def conv_net(blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("n", [4, 12])
def test_a_chain_of_linear_layers_costs_three_marks_per_layer(n):
    c = _count(linear_chain(n), torch.randn(8, 16))
    assert c.layers == c.forward_calls == n
    assert c.forward_marks == 2 * n and c.outer_marks == 0
    assert c.node_marks == n  # each output's node; the next layer's input node is the same one
    assert c.param_marks == 2  # the first layer's weight and bias: its input needs no gradient
    assert c.layer_marks == 3 * n + 2
    assert c.hook_calls == 2 * n + 2  # a forward wrapper per call, a node pre-hook per node


def test_a_small_conv_net_costs_three_marks_per_layer():
    c = _count(conv_net(3), torch.randn(2, 4, 6, 6))
    leaves = 3 * 3 + 2  # conv, batchnorm, relu per block; flatten; linear
    assert c.layers == c.forward_calls == leaves
    assert c.forward_marks == 2 * leaves and c.outer_marks == 0
    assert c.node_marks == leaves
    assert c.param_marks == 2  # the first convolution's weight and bias
    assert c.layer_marks == 3 * leaves + 2
    assert c.marks_per_leaf <= 3.2


def test_a_call_inside_an_instrumented_parent_takes_two_outer_marks():
    """A module with parameters of its own and children is a layer too: its children's
    calls take the outer marks that keep hookprof's own work out of the parent's time."""

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

        def forward(self, x):
            return self.inner(x * self.scale)

    c = _count(Parent(), torch.randn(8, 16))
    assert c.layers == c.forward_calls == 3
    assert c.forward_marks == 6 and c.outer_marks == 4  # two children, two outer marks each
    # the parent's input needs no gradient: it ends at its parameter's accumulation
    assert c.param_marks == 1
    assert c.marks == c.forward_marks + c.outer_marks + c.node_marks + c.param_marks + c.step_marks


def _count(model: nn.Module, x: torch.Tensor):
    return count_sampled_step(model, step_of(model, x))
