"""The spike replay's per-layer output sums (step/output_sums.py): what is summed, for whom, and
what is left after."""

from __future__ import annotations

import threading

import torch
from torch import nn

from hookprof.faults import Faults
from hookprof.layers import LayerTable
from hookprof.step import output_sums
from hookprof.step.output_sums import OutputSums
from hookprof.tensors import bits_sum
from support.hooks_left import MODULE_HOOK_DICTS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.hooked = nn.Tanh()

    def forward(self, x):
        return self.hooked(self.b(self.a(x) * 2))  # (a's output doubled by the model's own code)


def sums_of(model: nn.Module, run) -> tuple[list[tuple[int, torch.Tensor]], OutputSums]:
    sums = OutputSums(LayerTable(model), model, Faults())
    into: list[tuple[int, torch.Tensor]] = []
    with sums.installed():
        sums.collect(into)
        run()
        sums.collect(None)
    return into, sums


def test_each_layer_output_in_call_order_against_the_tests_own_sums():
    torch.manual_seed(0)
    model = Net()
    replaced = []

    def replace(module, args, output):  # a user's hook that replaces the output: it counts
        replaced.append(output + 1)
        return replaced[-1]

    model.hooked.register_forward_hook(replace)
    x = torch.randn(3, 4)
    into, _ = sums_of(model, lambda: model(x))
    a = model.a(x)
    b = model.b(a * 2)
    expected = [(0, bits_sum(a)), (1, bits_sum(b)), (2, bits_sum(replaced[-1]))]
    assert [(row, int(s)) for row, s in into] == [(row, int(s)) for row, s in expected]


def test_another_threads_calls_are_not_summed_and_nothing_is_while_not_collecting():
    model = Net()
    x = torch.randn(3, 4)

    def run():
        other = threading.Thread(target=lambda: model.a(x))
        other.start()
        other.join()
        model.b(x)

    into, sums = sums_of(model, run)
    assert [row for row, _ in into] == [1]
    with sums.installed():
        model(x)  # (not collecting)
    assert len(into) == 1


def test_too_many_calls_stop_the_collection(monkeypatch):
    monkeypatch.setattr(output_sums, "MAX_CALLS", 5)
    model = Net()
    x = torch.randn(3, 4)
    into, sums = sums_of(model, lambda: [model(x) for _ in range(3)])
    assert len(into) == 5 and sums.broken


def test_nothing_is_left_on_the_modules_after():
    model, twin = Net(), Net()
    model.hooked.register_forward_hook(lambda *a: None)
    twin.hooked.register_forward_hook(lambda *a: None)

    def left(m: nn.Module):
        return [
            (n, sorted(vars(c)), [len(getattr(c, d)) for d in MODULE_HOOK_DICTS])
            for n, c in m.named_modules()
        ]

    sums = OutputSums(LayerTable(model), model, Faults())
    with sums.installed():
        assert "forward" in vars(model.a) and len(model.hooked._forward_hooks) == 2
    assert left(model) == left(twin)
