"""N concurrent scrapers of one /metrics URL for a fixed time, as a separate process (the way
Prometheus servers load a training process). Prints one JSON line when done:
{"scrapes": n, "failures": [...], "steps": [[t, value], ...] per scraper, "non_monotonic": [...]}

    python tests/workers/load_scrapers.py URL --scrapers 20 --seconds 30 [--interval 1]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = (
    "hookprof_steps_total",
    "hookprof_sampled_steps_total",
    "hookprof_nonfinite_steps_total",
    "hookprof_layer_forward_seconds_count",
    "hookprof_layer_backward_seconds_count",
)


def counters(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def scraper(url: str, until: float, result: dict, interval: float) -> None:
    last: dict[str, float] = {}
    while time.monotonic() < until:
        if interval and result["scrapes"]:
            time.sleep(interval)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read().decode()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
            now = counters(body)
            result["scrapes"] += 1
            for key, value in now.items():
                if value < last.get(key, 0.0):
                    result["non_monotonic"].append([key, last[key], value])
            last.update(now)
        except Exception as exc:  # every failure is reported, none retried silently
            result["failures"].append(repr(exc))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--scrapers", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--interval", type=float, default=0.0, help="pause between one scraper's scrapes (0: none)"
    )
    args = parser.parse_args()
    until = time.monotonic() + args.seconds
    results = [{"scrapes": 0, "failures": [], "non_monotonic": []} for _ in range(args.scrapers)]
    threads = [
        threading.Thread(target=scraper, args=(args.url, until, r, args.interval)) for r in results
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(
        json.dumps(
            {
                "scrapes": sum(r["scrapes"] for r in results),
                "per_scraper": [r["scrapes"] for r in results],
                "failures": [f for r in results for f in r["failures"]],
                "non_monotonic": [m for r in results for m in r["non_monotonic"]],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
