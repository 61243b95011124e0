"""Training slowdown while concurrent scrapers hit /metrics, measured side by side.

One model trains with hookprof at its defaults. Two scraper processes (tests/load_scrapers.py,
N threads each) are paused (SIGSTOP) and resumed (SIGCONT) round by round:
- "hookprof": the scrapers hit the training process's own /metrics;
- "control": the same scrapers hit a copy of the same page served by a separate process
  (python -m http.server), which costs the machine the same client work (HTTP, parsing)
  without touching the training process. The difference between the two is hookprof's.

    python bench/scrape_load.py --rounds 20                 # back-to-back scrapes (stress)
    python bench/scrape_load.py --rounds 20 --interval 1    # each scraper once per second
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from overhead import WORKLOADS, Runner, workload_data

HERE = os.path.dirname(os.path.abspath(__file__))
SCRAPERS = os.path.join(HERE, "..", "tests", "load_scrapers.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="mlp", choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scrapers", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.0,
                        help="pause between one scraper's scrapes (0: back to back, a stress test)")
    args = parser.parse_args()
    w, base, x, y = workload_data(args.workload)
    runner = Runner("default", copy.deepcopy(base), x, y)
    runner.attach({})
    runner.timed_round(3)
    runner.prof.flush()
    means: dict[str, list[float]] = {"quiet": [], "control": [], "hookprof": []}
    procs = []
    with tempfile.TemporaryDirectory() as static:
        with urllib.request.urlopen(runner.prof.url, timeout=10) as r, open(os.path.join(static, "metrics"), "wb") as f:
            f.write(r.read())
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                       "--directory", static], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
        loads = {}
        for name, url in (("control", f"http://127.0.0.1:{port}/metrics"), ("hookprof", runner.prof.url)):
            loads[name] = subprocess.Popen([sys.executable, SCRAPERS, url, "--scrapers", str(args.scrapers),
                                            "--seconds", "3600", "--interval", str(args.interval)],
                                           stdout=subprocess.DEVNULL)
            procs.append(loads[name])
            os.kill(loads[name].pid, signal.SIGSTOP)
        try:
            names = list(means)
            for i in range(args.rounds):
                for name in names[i % 3:] + names[: i % 3]:
                    for other, proc in loads.items():
                        os.kill(proc.pid, signal.SIGCONT if other == name else signal.SIGSTOP)
                    time.sleep(0.3)  # let the scrapers stop, or get going
                    runner.round_means.clear()
                    runner.timed_round(args.steps)
                    means[name].append(runner.round_means[0])
            renders = runner.prof._server.page.renders
        finally:
            for proc in procs:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(timeout=30)
            runner.prof.detach()
    pace = f"every {args.interval:g} s each" if args.interval else "back to back"
    q = statistics.median(means["quiet"])
    print(f"# {w.name}, hookprof default: {args.rounds} rounds x {args.steps} steps, "
          f"{args.scrapers} concurrent scrapers ({pace}); the page was rendered {renders} times")
    for name, label in (("quiet", "no scrapes"), ("control", "scrapers on a separate server"),
                        ("hookprof", "scrapers on hookprof's /metrics")):
        m = statistics.median(means[name])
        print(f"{label:34s} {m * 1e3:7.2f} ms/step  {m / q:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
