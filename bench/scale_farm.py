"""What hookprof's series cost a Prometheus at many ranks, measured (issue 42 item 3).

A farm of simulated ranks (tests/support/farm.py: one process serving every rank's /metrics
page, each rendered by hookprof's own exporter from a synthetic snapshot that advances with
the clock) is scraped by a real Prometheus configured by deploy/scale/prometheus.yml
(hookprof's rules, remote_write of the aggregates) into a real VictoriaMetrics single node.
For each size it prints Prometheus's resident memory and head series, the rule groups'
evaluation time, the scrape time per rank, and the series that reach the long-term store;
then, with one rank of `--latency-ranks` slowed 40% in one layer's forward, how long
HookprofStragglerLayer takes to fire and whom it names.

    python bench/scale_farm.py                       # 64, 128, 256, 512 ranks x 50 layers
    python bench/scale_farm.py --sizes 32 --latency-ranks 0   # a quick look

Needs Debian's prometheus and victoria-metrics. Every server binds 127.0.0.1 and is stopped
whatever happens. The farm renders its pages on the same cores as Prometheus: on a 2-core
machine the figures are an upper bound of Prometheus's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import paths  # noqa: F401  (first: this checkout's hookprof and the test helpers)

from support.farm import Slowdown, layer_name
from support.scale import scale_run

SLOW_LAYER = layer_name(2)


def measure(
    ranks: int, layers: int, interval: str, settle_s: float, detailed: int | None = None
) -> dict:
    with (
        tempfile.TemporaryDirectory() as tmp,
        scale_run(tmp, ranks, layers, interval=interval, detailed=detailed) as run,
    ):
        time.sleep(settle_s)  # every rank past its first five samples, the store written
        figures = {
            "ranks": ranks,
            "layers": layers,
            "detailed": detailed,
            "head_series": run.own("prometheus_tsdb_head_series"),
            "rss_mb": run.prometheus_rss_bytes() / 1e6,
            "heap_inuse_mb": run.own("go_memstats_heap_inuse_bytes") / 1e6,
            "rules_s": run.rule_group_seconds(),
            "layer_rules_s": run.rule_group_seconds("hookprof.layer_stragglers"),
            "scrape_s_mean": run.value("avg(scrape_duration_seconds)"),
            "samples_per_scrape": run.value("sum(scrape_samples_scraped)"),
            "store_series": run.store_series(),
            "store_names": run.store_names(),
        }
    return figures


def latency(
    ranks: int,
    layers: int,
    interval: str,
    slow_after_s: float,
    limit_s: float,
    detailed: int | None = None,
) -> dict:
    slow = Slowdown(ranks // 2, SLOW_LAYER, 1.4, "forward", slow_after_s)
    with (
        tempfile.TemporaryDirectory() as tmp,
        scale_run(tmp, ranks, layers, interval=interval, slowdown=slow, detailed=detailed) as run,
    ):
        started = run.farm.started_at + slow_after_s  # (the farm's clock: time.monotonic)
        deadline = started + limit_s
        firing: list[dict] = []
        while time.monotonic() < deadline:
            firing = run.firing("HookprofStragglerLayer")
            if firing:
                break
            time.sleep(1.0)
        after = time.monotonic() - started
        named = [(a["labels"]["rank"], a["labels"]["layer"], a["labels"]["phase"]) for a in firing]
        return {
            "ranks": ranks,
            "slowed": (str(slow.rank), slow.layer, slow.phase),
            "fired_after_s": round(after, 1) if firing else None,
            "named": named,
            "ratio": float(firing[0]["value"]) if firing else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="64,128,256,512", help="simulated ranks, comma-separated"
    )
    parser.add_argument("--layers", type=int, default=50, help="layers per rank")
    parser.add_argument(
        "--detailed",
        type=int,
        default=None,
        help="layers with every figure (Config.detailed_layers); the rest timed alone",
    )
    parser.add_argument("--interval", default="5s", help="scrape and evaluation interval")
    parser.add_argument("--settle", type=float, default=75.0, help="seconds before reading")
    parser.add_argument("--latency-ranks", type=int, default=512, help="0: no latency run")
    parser.add_argument("--slow-after", type=float, default=90.0, help="seconds into the run")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds to wait for it")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    results: dict = {"sizes": [], "latency": None}
    print(
        "| ranks | layers | head series | Prometheus RSS MB | Go heap MB | rules s/eval "
        "(layer rules) | scrape s/rank | series in the store |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for ranks in [int(s) for s in args.sizes.split(",") if s]:
        f = measure(ranks, args.layers, args.interval, args.settle, args.detailed)
        results["sizes"].append(f)
        print(
            f"| {ranks} | {args.layers} | {f['head_series']:,.0f} | {f['rss_mb']:.0f} | "
            f"{f['heap_inuse_mb']:.0f} | {f['rules_s']:.3f} ({f['layer_rules_s']:.3f}) | "
            f"{f['scrape_s_mean']:.3f} | {f['store_series']:,} |",
            flush=True,
        )
    if results["sizes"]:
        print("names in the store:", ", ".join(results["sizes"][-1]["store_names"]))
    if args.latency_ranks:
        lat = latency(
            args.latency_ranks,
            args.layers,
            args.interval,
            args.slow_after,
            args.limit,
            args.detailed,
        )
        results["latency"] = lat
        print(
            f"one of {lat['ranks']} ranks slowed 40% in {lat['slowed'][1]} ({lat['slowed'][2]}): "
            f"HookprofStragglerLayer fired {lat['fired_after_s']} s after the slowdown began, "
            f"naming {lat['named']} (ratio {lat['ratio']})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
