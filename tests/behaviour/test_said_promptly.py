"""Issue 41, item 4: under `warn`, the NaN line is said within one step (or one publish
interval) of the bad step's flags reaching the host, in a loop of 1 s steps: at once on a CPU,
where the flags are readable at once; one step after they arrive on a device 3 steps behind
(tests/support/lagging_device.py). Forward and backward NaNs, as the demo's model makes them."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

import hookprof
from hookprof.demo import DemoNet, InjectNonFinite
from support.first_nan import behind_by

BAD_STEP = 4
STEP_S = 1.0

pytestmark = pytest.mark.slow  # ~1 s a step, by design


@pytest.mark.parametrize("lag", [0, 3], ids=["cpu", "device 3 steps behind"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_nan_line_comes_within_a_step_of_its_flags(phase, lag):
    torch.manual_seed(0)
    model = DemoNet()
    injector = InjectNonFinite(model.mlp[0], set(), count_calls=False)
    if phase == "forward":
        injector.at = {BAD_STEP}
    else:  # the test's own hook makes mlp.2's weight gradient NaN at BAD_STEP
        model.mlp[2].weight.register_hook(
            lambda g: g * float("nan") if injector.step == BAD_STEP else g
        )
    said: list[tuple[int, float, str]] = []
    step, bad_at = 0, None

    class Heard(logging.Handler):
        def emit(self, record):
            said.append((step, time.monotonic(), record.getMessage()))

    heard = Heard()
    logging.getLogger("hookprof").addHandler(heard)
    try:
        with behind_by(lag):
            prof = hookprof.attach(model, port=0, summary_at_exit=False, on_nonfinite="warn")
            try:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                generator = torch.Generator().manual_seed(0)
                for step in range(1, BAD_STEP + lag + 3):
                    injector.step = step
                    tokens, labels = model.batch(generator)
                    loss = nn.functional.cross_entropy(model(tokens), labels)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    prof.step(loss)
                    if step == BAD_STEP:
                        bad_at = time.monotonic()
                    if any(f"in the {phase} phase at step {BAD_STEP}" in m for _, _, m in said):
                        break
                    time.sleep(STEP_S)
            finally:
                prof.detach()
    finally:
        logging.getLogger("hookprof").removeHandler(heard)
    lines = [(s, t) for s, t, m in said if f"in the {phase} phase at step {BAD_STEP}" in m]
    assert lines, said
    line_step, line_time = lines[0]
    # the flags reach the host `lag` steps after the bad one; the line at most one step later
    assert line_step <= BAD_STEP + lag + 1, (line_step, said)
    assert line_time - bad_at <= (lag + 1) * STEP_S + 1.0, (line_time - bad_at, said)
