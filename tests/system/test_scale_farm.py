"""Issue 42 item 3 at a small size, in CI: simulated ranks (support/farm.py) whose pages
hookprof's own exporter renders, scraped by a real Prometheus configured by
deploy/scale/prometheus.yml, which evaluates hookprof's rules and remote_writes only the
aggregates to a real VictoriaMetrics. bench/scale_farm.py runs the same at hundreds of ranks
and measures it (docs/scale.md)."""

from __future__ import annotations

import re

import pytest
import yaml

from support.farm import Slowdown, layer_name
from support.scale import CONFIG, scale_run
from support.waiting import wait_for

RANKS, LAYERS = 32, 20
SLOW = Slowdown(rank=17, layer=layer_name(3), factor=1.4, phase="backward", after_s=0.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with scale_run(
        str(tmp_path_factory.mktemp("scale")), RANKS, LAYERS, interval="1s", slowdown=SLOW
    ) as running:
        wait_for(
            "every rank's layers in the straggler rules",
            lambda: (
                running.value("count(hookprof:layer_seconds_per_call:ratio_to_median_of_ranks)")
                == RANKS * LAYERS * 2
            ),
            timeout=60,
        )
        yield running


def test_every_rank_is_scraped_and_its_layers_compared(run):
    # every series of every page, as hookprof's exporter rendered it
    per_page = sum(
        1 for line in run.farm.page(0).decode().splitlines() if line and not line.startswith("#")
    )
    assert run.value('sum(scrape_samples_scraped{job="hookprof"})') == RANKS * per_page
    ratios = {
        (r["metric"]["rank"], r["metric"]["layer"], r["metric"]["phase"]): float(r["value"][1])
        for r in run.query("hookprof:layer_seconds_per_call:ratio_to_median_of_ranks")
    }
    slowed = (str(SLOW.rank), SLOW.layer, SLOW.phase)
    assert ratios[slowed] == pytest.approx(
        SLOW.factor * run.farm.per_call(SLOW.rank, 3, SLOW.phase) / _median_per_call(run, 3),
        rel=0.02,
    )
    assert all(v < 1.1 for k, v in ratios.items() if k != slowed)  # the farm's spread is 3%


def _median_per_call(run, layer: int) -> float:
    values = sorted(run.farm.per_call(r, layer, SLOW.phase) for r in range(RANKS))
    return (values[RANKS // 2 - 1] + values[RANKS // 2]) / 2


def test_the_straggler_alert_names_the_one_slow_rank_among_many(run):
    def pending_or_firing():
        alerts = run.query('ALERTS{alertname="HookprofStragglerLayer"}')
        return [(a["metric"]["rank"], a["metric"]["layer"], a["metric"]["phase"]) for a in alerts]

    named = wait_for("HookprofStragglerLayer pending", pending_or_firing, timeout=30)
    assert named == [(str(SLOW.rank), SLOW.layer, SLOW.phase)]


def test_only_the_aggregates_reach_the_long_term_store(run):
    with open(CONFIG) as f:
        keep = yaml.safe_load(f)["remote_write"][0]["write_relabel_configs"][0]["regex"]
    # one series per layer and phase for the whole job, not one per rank
    medians = wait_for(
        "the layers' median of ranks readable in VictoriaMetrics",
        lambda: run.query(
            "count(hookprof:layer_seconds_per_call:median_of_ranks)", port=run.vm_port
        ),
        timeout=60,
    )
    assert float(medians[0]["value"][1]) == LAYERS * 2
    names = run.store_names()
    assert all(re.fullmatch(keep, name) for name in names), names
    assert not any(name.startswith("hookprof_layer_") for name in names)
    # and far fewer series in the store than the job makes
    assert run.store_series() * 20 < run.own("prometheus_tsdb_head_series")
