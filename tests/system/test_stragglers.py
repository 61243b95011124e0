"""The straggler rule and panels against a real Prometheus scraping a real 2-rank job
(torch.distributed, gloo) in which rank 1 is deliberately slowed down."""

from __future__ import annotations

import json

import pytest

from support.dashboard import JOB, alert_rules, dashboard, panel_queries, substitute
from support.servers import binaries, get_json, query, ranks_scraped
from support.waiting import wait_for

DELAYS = (0.005, 0.06)  # seconds of sleep per step: rank 1 is the straggler


@pytest.fixture(scope="module")
def two_ranks_scraped(tmp_path_factory):
    binaries()  # skips where Prometheus is not installed
    from workers.straggler_worker import run_rank

    tmp = str(tmp_path_factory.mktemp("straggler"))
    with ranks_scraped(
        run_rank, lambda r, out, go_home: (DELAYS, out, go_home), 2, tmp, JOB, scrapes=4
    ) as (prom, _):
        yield prom


def test_the_straggler_rule_picks_the_slowed_rank(two_ranks_scraped):
    (rule,) = [r for r in alert_rules() if r.get("alert") == "HookprofStragglerRank"]
    result = query(two_ranks_scraped, rule["expr"])
    assert [r["metric"]["rank"] for r in result] == ["1"], result
    # its value is rank 1's mean step time: at least its sleep, and well above rank 0's
    assert float(result[0]["value"][1]) >= DELAYS[1]
    # and Prometheus evaluates it into a pending alert for rank 1 alone (it fires after 10m)
    alerts = wait_for(
        "the straggler alert pending",
        lambda: [
            a
            for a in get_json(f"http://127.0.0.1:{two_ranks_scraped}/api/v1/alerts")["data"][
                "alerts"
            ]
            if a["labels"]["alertname"] == "HookprofStragglerRank"
        ],
        timeout=20,
    )
    assert [(a["labels"]["rank"], a["state"]) for a in alerts] == [("1", "pending")], json.dumps(
        alerts
    )


def test_the_straggler_panels_show_the_ratio_to_the_median(two_ranks_scraped):
    queries: dict[str, list[str]] = {}
    for title, expr in panel_queries(dashboard()):
        queries.setdefault(title, []).append(expr)
    (ratio,) = query(two_ranks_scraped, substitute(queries["Slowest rank over the median"][0]))
    each, median = queries["Step time per rank and the median of ranks"]
    per_rank = {
        r["metric"]["rank"]: float(r["value"][1])
        for r in query(two_ranks_scraped, substitute(each))
    }
    assert set(per_rank) == {"0", "1"} and per_rank["1"] > 3 * per_rank["0"]
    (mid,) = query(two_ranks_scraped, substitute(median))
    assert float(mid["value"][1]) == pytest.approx(sum(per_rank.values()) / 2, rel=0.15)
    # two ranks: the median is their mean, so slowest / median = 2 * slow / (slow + fast)
    expected = 2 * per_rank["1"] / (per_rank["0"] + per_rank["1"])
    assert float(ratio["value"][1]) == pytest.approx(expected, rel=0.15)  # two instants apart
    assert float(ratio["value"][1]) > 1.5
