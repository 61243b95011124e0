"""One straggler found end to end (issue 42 item 4; docs/efficiency.md, "One straggler, end
to end", was made with it): 3 DDP ranks over gloo on the CPU, rank 1's blocks.2.fc 40% slower
in its forward, scraped by a real Prometheus with hookprof's rules. Prints the alert once it
fires, the dashboard's rank x layer table (its query, run), and `hookprof top --once` of the
slow rank and of a normal one. Needs Debian's prometheus; ~3 minutes.

    python bench/straggler_end_to_end.py
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time

import paths  # noqa: F401  (first: this checkout's hookprof and the test helpers)
import torch.multiprocessing as mp

from support.dashboard import JOB, dashboard, panel_queries, substitute
from support.servers import get_json, query, ranks_scraped
from support.waiting import wait_for
from workers.layer_straggler_worker import run_rank

EXTRA = 0.0008  # seconds more per call on rank 1 (2.8 ms against the workers' 2 ms)


def main() -> None:
    extra = [(0.0, 0.0), (EXTRA, 0.0), (0.0, 0.0)]
    stop_at = mp.get_context("spawn").Value("i", 0)
    with tempfile.TemporaryDirectory() as tmp:
        with ranks_scraped(
            run_rank, lambda r, out, go_home: (extra, out, go_home, stop_at), 3, tmp, JOB, scrapes=3
        ) as (prom, workers):

            def firing():
                return [
                    a
                    for a in get_json(f"http://127.0.0.1:{prom}/api/v1/alerts")["data"]["alerts"]
                    if a["labels"]["alertname"] == "HookprofStragglerLayer"
                    and a["labels"]["layer"] == "blocks.2.fc"
                ]

            wait_for("the straggler alert pending", firing, timeout=120)
            started = time.monotonic()
            while time.monotonic() - started < 90 and not any(
                a["state"] == "firing" for a in firing()
            ):
                time.sleep(2)
            print("ALERTS", json.dumps(firing(), indent=1))
            (expr,) = [
                e
                for t, e in panel_queries(dashboard())
                if t == "Layer time per rank over the median of ranks"
            ]
            rows = query(prom, substitute(expr))
            print("TABLE")
            for r in rows[:8]:
                print(
                    r["metric"]["cell"], "rank", r["metric"]["rank"], round(float(r["value"][1]), 2)
                )
            inst = {
                r["metric"]["rank"]: r["metric"]["instance"]
                for r in query(prom, "hookprof_steps_total")
            }
            for rank in ("1", "0"):
                out = subprocess.run(
                    ["hookprof", "top", "--once", inst[rank]],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                print(f"TOP rank {rank}\n" + out.stdout[:3000] + out.stderr[-500:])


if __name__ == "__main__":
    main()
