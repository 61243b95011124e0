"""The compiled output check's eager side (nonfinite/traced.py): note_output runs here as
Dynamo would trace it (plain tensor ops), take() turns the counters into the step's flags."""

from __future__ import annotations

import torch

from hookprof.nonfinite.traced import TracedOutputCheck


def test_take_gives_the_last_forwards_flag_and_the_steps_and_starts_over():
    check = TracedOutputCheck(torch.device("cpu"))
    assert check.take() is None  # no compiled forward yet
    bad = torch.tensor([1.0, float("inf")])
    for output in (bad, torch.ones(3)):  # two forwards: the first non-finite
        check.note_inputs((torch.ones(2),), {})
        check.note_output(output)
    last, any_forward, inputs = check.take()
    assert (last, any_forward) == (False, True) and inputs[0][0].shape == (2,)
    check.note_inputs((torch.ones(2),), {})
    check.note_output({"logits": bad, "aux": [torch.ones(1)]})
    assert check.take()[:2] == (True, True)
    assert check.counts.tolist() == [0, 0]


def test_inputs_on_another_device_move_the_counters_and_say_so_once():
    said = []
    check = TracedOutputCheck(torch.device("meta"), say=lambda key, text: said.append((key, text)))
    check.note_inputs((torch.ones(2),), {})
    check.note_output(torch.tensor([float("nan")]))  # on the CPU: not the counters' device
    assert check.take() is None  # unchecked, and said
    assert check.counts.device.type == "cpu" and said and "cpu" in said[0][1]
    check.note_inputs((torch.ones(2),), {})
    check.note_output(torch.tensor([float("nan")]))
    assert check.take()[:2] == (True, True)  # checked from then on
