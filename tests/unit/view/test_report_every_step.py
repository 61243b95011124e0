"""The report's every-step charts (issue 41), read back from the page of a run that diverged
on its own (a learning rate that grows until the loss overflows) and went on long after:
the lead-up step by step, older steps as bands, non-finite steps as ticks whose count is the
counters', an axis on the finite values."""

from __future__ import annotations

import math
import re

import pytest
import torch

import hookprof
from hookprof.publish import every_step
from hookprof.view.report_html import render
from support.models import DeepNet, loss_of, seeded
from support.rendered import Elements, inside, line_of, number

STEPS, GROW_FROM = 1300, 700


def _diverging_document():
    model = seeded(DeepNet)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = {}
    with hookprof.attach(model, port=0, summary_at_exit=False) as prof:
        for step in range(1, STEPS + 1):
            if step >= GROW_FROM:
                for group in opt.param_groups:
                    group["lr"] *= 1.08
            opt.zero_grad()
            loss = loss_of(model, model.batch(g))
            loss.backward()
            opt.step()
            prof.step(loss)
            losses[step] = float(loss)
        prof.flush()
        return prof.report_document(), losses


def test_the_lead_up_bands_and_ticks_of_a_divergence():
    doc, losses = _diverging_document()
    first_bad = min(s for s, v in losses.items() if not math.isfinite(v))
    assert first_bad < STEPS - every_step.FULL  # the incident left the recent window
    assert doc["first_nonfinite"]["step"] == first_bad
    el = Elements(render([doc]))
    page_text = "".join(el.text)
    (svg,) = el.find("svg", **{"data-kind": "loss"})
    line = line_of(el, svg)
    steps = [float(s) for s in line["data-steps"].split()]
    values = line["data-values"].split()
    # every step before the incident, back to LEAD_UP steps, is drawn with the loop's loss
    for s in range(first_bad - every_step.LEAD_UP, first_bad):
        (k,) = [i for i, x in enumerate(steps) if x == s and "~" not in values[i]]
        assert number(values[k]) == pytest.approx(losses[s], rel=1e-6)
    # the bands: each one's min/max/mean the loop's over the steps it covers
    bands = inside(el, svg, "rect", "band")
    assert bands
    for b in bands:
        covered = [losses[s] for s in range(int(b["data-first"]), int(b["data-last"]) + 1)]
        finite = [v for v in covered if math.isfinite(v)]
        assert float(b["data-min"]) == pytest.approx(min(finite), rel=1e-6)
        assert float(b["data-max"]) == pytest.approx(max(finite), rel=1e-6)
    # the ticks: as many non-finite steps as the counters' loss phase, none drawn twice
    ticks = inside(el, svg, "rect", "nonfinite-tick")
    counted = sum(int(float(t.get("data-count", "1"))) for t in ticks)
    assert (
        counted
        == doc["nonfinite_steps"]["loss"]
        == sum(1 for v in losses.values() if not math.isfinite(v))
    )
    said = re.search(r"([\d,]+) of these steps had a non-finite value", page_text)
    assert said and int(said[1].replace(",", "")) == counted
    # every figure says its window: the mean step time over all steps, the table's times
    # and shares over the sampled steps, whose count the heading gives (test_report_one_window)
    assert f"mean step time, all {STEPS:,} steps" in page_text
    assert f"over the {doc['sampled_steps']:,} sampled steps" in page_text
    assert f"of the mean time of the same {doc['sampled_steps']:,} sampled steps" in page_text
    # the axis is the finite values' (a log axis: the loss grew by many powers of ten)
    assert svg["data-log"] == "1"
    ytick_values = [float(t["data-value"]) for t in inside(el, svg, "text", "ytick")]
    finite = [v for v in losses.values() if math.isfinite(v)]
    assert ytick_values[0] <= min(finite) and ytick_values[-1] >= max(finite)
    # within one tick of them, not scaled to an infinity; few enough labels not to overlap
    ratio = ytick_values[1] / ytick_values[0]
    assert ytick_values[-1] < ratio * max(finite) and len(ytick_values) <= 10
