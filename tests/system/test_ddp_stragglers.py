"""The straggler rules and panels against a real Prometheus scraping a real 2-rank job whose
ranks synchronise every step (DistributedDataParallel, and FSDP2, over gloo on the CPU), in
which rank 1's data loading is slowed down.

Both ranks finish every step together: the step time rule (HookprofStragglerRank) cannot
see the straggler. The fast rank's wait lands in the phase of its next collective: backward
under DDP (the gradient all-reduce), forward under FSDP (the all-gathers), where it stands
out from the median of two as much as the straggler's data phase does. HookprofStragglerPhase
names rank 1 and its data phase, and not rank 0."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from support.dashboard import JOB, alert_rules, dashboard, panel_queries, substitute
from support.servers import binaries, get_json, query, ranks_scraped
from support.waiting import wait_for

DELAY = 0.06  # seconds of sleep in rank 1's data phase, every step


# (set-up of tests/workers/ddp_straggler_worker.py, the phase where rank 0 waits: measured by
# bench/straggler_wait_phase.py, checked here)
SETUPS = {"ddp": "backward", "fsdp": "forward"}


@pytest.fixture(scope="module", params=list(SETUPS))
def synced_ranks_scraped(request, tmp_path_factory):
    binaries()  # skips where Prometheus is not installed
    from workers.ddp_straggler_worker import run_rank

    stop_at = mp.get_context("spawn").Value("i", 0)  # the step every rank stops after
    tmp = str(tmp_path_factory.mktemp("ddp_straggler"))
    with ranks_scraped(
        run_rank,
        lambda r, out, go_home: ((0.0, DELAY), "data", out, go_home, stop_at, request.param),
        2,
        tmp,
        JOB,
        scrapes=5,
    ) as (prom, workers):
        yield prom, SETUPS[request.param]
    assert [w.exitcode for w in workers] == [0, 0]  # both stopped after the same step


def rule(name: str) -> dict:
    (found,) = [r for r in alert_rules() if r.get("alert") == name]
    return found


def by_rank_and_phase(result: list[dict]) -> dict[tuple[str, str], float]:
    return {(r["metric"]["rank"], r["metric"]["phase"]): float(r["value"][1]) for r in result}


def test_equal_step_times_leave_the_step_time_rule_blind(synced_ranks_scraped):
    """The bug this fixes: the slowed rank's step is no longer than the other's."""
    prom, _ = synced_ranks_scraped
    steps = {
        r["metric"]["rank"]: float(r["value"][1])
        for r in query(
            prom,
            "sum by (rank) (rate(hookprof_step_duration_seconds_sum[1m]))"
            " / sum by (rank) (rate(hookprof_step_duration_seconds_count[1m]))",
        )
    }
    assert set(steps) == {"0", "1"} and min(steps.values()) >= DELAY, steps
    assert steps["1"] == pytest.approx(steps["0"], rel=0.05)
    assert query(prom, rule("HookprofStragglerRank")["expr"]) == []


def test_the_fast_rank_waits_in_its_collectives_phase(synced_ranks_scraped):
    """Where the wait lands (measured, not assumed): rank 0's backward (DDP) or forward (FSDP)
    is longer than rank 1's by about what rank 1's data phase is longer than rank 0's."""
    prom, wait = synced_ranks_scraped
    means = by_rank_and_phase(query(prom, "hookprof:step_phase_seconds:mean5m"))
    assert {phase for _, phase in means} == {"data", "forward", "backward", "optimizer", "other"}
    slow_data = means["1", "data"] - means["0", "data"]
    waited = means["0", wait] - means["1", wait]
    assert slow_data >= 0.8 * DELAY  # the sleep, less what rank 0 does in its own data phase
    assert waited == pytest.approx(slow_data, rel=0.25)
    assert max(means[r, p] for r, p in means if r == "0") == means["0", wait]


def test_the_phase_rule_names_rank_1_and_its_data_phase(synced_ranks_scraped):
    prom, wait = synced_ranks_scraped
    expr = rule("HookprofStragglerPhase")["expr"]
    result = wait_for("the phase rule's expression", lambda: query(prom, expr), timeout=20)
    assert [(r["metric"]["rank"], r["metric"]["phase"]) for r in result] == [("1", "data")], result
    assert float(result[0]["value"][1]) >= DELAY  # rank 1's mean data phase
    # rank 0's wait stands out from the median of two as well: the rule leaves it out
    above = by_rank_and_phase(query(prom, "hookprof:step_phase_seconds:above_median_of_ranks5m"))
    assert set(above) == {("1", "data"), ("0", wait)}, above
    alerts = wait_for(
        "the phase straggler alert pending",
        lambda: [
            a
            for a in get_json(f"http://127.0.0.1:{prom}/api/v1/alerts")["data"]["alerts"]
            if a["labels"]["alertname"].startswith("HookprofStraggler")
        ],
        timeout=20,
    )
    assert [
        (a["labels"]["alertname"], a["labels"]["rank"], a["labels"]["phase"], a["state"])
        for a in alerts
    ] == [("HookprofStragglerPhase", "1", "data", "pending")], json.dumps(alerts)


def test_the_straggler_panels_show_the_phase_comparison(synced_ranks_scraped):
    prom, wait = synced_ranks_scraped
    queries: dict[str, list[str]] = {}
    for title, expr in panel_queries(dashboard()):
        queries.setdefault(title, []).append(expr)

    def panel(title: str) -> dict[tuple[str, str], float]:
        (expr,) = queries[title]
        return by_rank_and_phase(query(prom, substitute(expr)))

    # each panel at its own instant, a second or so apart: approximate comparisons
    means = panel("Step time by phase")
    ratio = panel("Step phases per rank over the median of ranks")
    above = panel("Step phases per rank above the median of ranks")
    # two ranks: the median is their mean
    for rank, other, phase in (("1", "0", "data"), ("0", "1", wait)):
        mine, theirs = means[rank, phase], means[other, phase]
        assert ratio[rank, phase] == pytest.approx(2 * mine / (mine + theirs), rel=0.2)
        assert above[rank, phase] == pytest.approx((mine - theirs) / 2, rel=0.25)
    assert ratio["1", "data"] > 1.5 and above["1", "data"] > DELAY / 2 * 0.8
    assert above["0", "data"] < 0 and above["1", wait] < 0
