"""The layer table's shares and the step time they are of come from the same steps (issue 41
item 2): the sampled steps, whose wall time is kept (hookprof_sampled_step_seconds_total). Read
back from a known run's report page, its /metrics page (what `hookprof top` reads) and the
every-step history, which times every step on its own path."""

from __future__ import annotations

import urllib.request

import pytest

import hookprof
from hookprof.view.report_html import render
from hookprof.view.table import from_document, from_metrics
from support.models import DeepNet, seeded, train
from support.rendered import Elements

STEPS, EVERY = 30, 3


def test_shares_are_of_the_mean_time_of_the_sampled_steps_the_layer_times_come_from():
    model = seeded(DeepNet)
    with hookprof.attach(
        model, port=0, summary_at_exit=False, sample_every=EVERY, min_sample_interval_s=0.0
    ) as prof:
        train(model, STEPS, prof=prof, lr=0.01, explicit_step=True)
        prof.flush()
        doc = prof.report_document()
        page = urllib.request.urlopen(prof.url, timeout=10).read().decode()
    sampled = [int(s) for s in doc["history"]["points"]["step"]]
    assert len(sampled) == doc["sampled_steps"] == STEPS // EVERY
    # the sampled steps' wall time is the sum of those steps' own times in the every-step
    # series (a path of its own: the step's slot of the ring, not the sampled step's packet)
    full = doc["history"]["every_step"]["full"]
    seconds_of = dict(zip(full["step"], full["step_seconds"]))
    window = doc["sampled_step_seconds_sum"]
    assert window == pytest.approx(sum(seconds_of[s] for s in sampled), rel=1e-9)
    assert window < doc["step_seconds_sum"]  # not all steps: a window of its own
    # each share is the layer's time over that window: the report's table and `top`'s agree
    table = from_document(doc)
    totals = {layer["name"]: layer for layer in doc["layer_totals"]}
    timed = [row for row in table.rows if row.share is not None]
    assert timed
    layers_total = sum(
        t["forward_seconds_total"] + t["backward_seconds_total"] for t in totals.values()
    )
    assert layers_total < window  # (else shares would be of the layers' own total)
    for row in timed:
        t = totals[row.layer]
        expected = (t["forward_seconds_total"] + t["backward_seconds_total"]) / window
        assert row.share == pytest.approx(expected, rel=1e-9)
    (scraped,) = from_metrics(page)
    assert scraped.header.sampled_step_seconds == pytest.approx(window, rel=1e-9)
    by_layer = {row.layer: row.share for row in scraped.rows}
    for row in timed:
        assert by_layer[row.layer] == pytest.approx(row.share, rel=1e-6)
    # the page says the window of each figure, with the numbers above
    pieces = Elements(render([doc])).text
    text = "".join(pieces)
    n = len(sampled)
    shown = pieces[pieces.index(f"mean sampled step, the layers' {n:,}") + 1]
    assert float(shown.removesuffix(" ms")) == pytest.approx(window / n * 1e3, rel=1e-3)
    assert f"mean step time, all {STEPS:,} steps" in text
    assert f"mean sampled step, the layers' {n:,}" in text
    assert f"over the {n:,} sampled steps" in text
    assert f"share: of the mean time of the same {n:,} sampled steps" in text
