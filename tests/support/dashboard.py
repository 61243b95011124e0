"""The shipped Grafana dashboard and Prometheus rules, read for their queries, with the
dashboard's variables put in as Grafana would for the demo's job."""

from __future__ import annotations

import json

from support.paths import DASHBOARD, RULES

JOB = "hookprof-demo"  # the job the system tests scrape, which substitute() selects
# what Grafana puts in place of each variable: one concrete job, "All" (".*") elsewhere,
# and windows a 1 s scrape interval fills ($__rate_interval is 4 scrape intervals at least).
# model=~".*" also matches series without a `model` label (Prometheus 2.42): every panel
# returning data shows the board works with an exporter that does not emit it yet
VARIABLES = {
    "$job": JOB,
    "$model": ".*",
    "$instance": ".*",
    "$rank": ".*",
    "$layer": ".*",
    "$topk": "10",
    "$__rate_interval": "5s",
    "$__range": "1m",
}


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):  # $__range before $__rate...: no overlap
        expr = expr.replace(name, VARIABLES[name])
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def dashboard() -> dict:
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def panel_queries(board: dict) -> list[tuple[str, str]]:
    return [
        (p["title"], t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def alert_rules() -> list[dict]:
    import yaml

    with open(RULES, encoding="utf-8") as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
