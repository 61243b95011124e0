"""The metrics endpoint under load: what clients of /metrics cost a training process.

    python bench/endpoint.py scrape-load --rounds 20                 # back-to-back scrapes (stress)
    python bench/endpoint.py scrape-load --rounds 20 --interval 1    # each scraper once per second
    python bench/endpoint.py attack idle --connections 500 [--tls]
    python bench/endpoint.py attack slowloris --connections 3000

scrape-load (was bench/scrape_load.py, same options): training slowdown while concurrent
scrapers hit /metrics, side by side. One model trains with hookprof at its defaults. Two
scraper processes (tests/workers/load_scrapers.py, N threads each) are paused (SIGSTOP) and resumed
(SIGCONT) round by round:
- "hookprof": the scrapers hit the training process's own /metrics;
- "control": the same scrapers hit a copy of the same page served by a separate process
  (python -m http.server), which costs the machine the same client work (HTTP, parsing)
  without touching the training process. The difference between the two is hookprof's.

attack (was bench/endpoint_attack.py --attack KIND, same other options): threads, memory and
scrape latency of a training process while another process holds N connections open against
its /metrics. "idle": connect, send nothing (with TLS, never a ClientHello); "slowloris":
half a request line, then a byte every few seconds. The training process trains a small
model in its main thread; the attacker process, once its connections are open, scrapes
/metrics ten times on new connections and reports the latencies. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import paths  # first: the hookprof under test (HOOKPROF_ROOT's or this checkout's) and the tests' helpers

SCRAPERS = os.path.join(paths.TESTS, "workers", "load_scrapers.py")


def serve_copy(page: bytes, directory: str) -> tuple[subprocess.Popen, str]:
    """A separate process serving `page` as /metrics from `directory`: (process, its URL)."""
    with open(os.path.join(directory, "metrics"), "wb") as f:
        f.write(page)
    # port 0: the server picks a free one and says which on its first line
    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
            "--directory",
            directory,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    port = proc.stdout.readline().split(" port ")[1].split()[0]
    return proc, f"http://127.0.0.1:{port}/metrics"


def scrape_load(args: argparse.Namespace) -> int:
    """Step time with no scrapers, with scrapers on a separate server, with scrapers on
    hookprof's own /metrics: rounds interleaved in rotating order."""
    from overhead import WORKLOADS, Runner, workload_data

    from hookprof._testing import metrics_page

    if args.workload not in WORKLOADS:
        raise SystemExit(f"--workload must be one of {sorted(WORKLOADS)}, got {args.workload!r}")
    w, base, x, y = workload_data(args.workload)
    runner = Runner("default", copy.deepcopy(base), x, y)
    runner.attach({})
    runner.timed_round(3)
    runner.prof.flush()
    means: dict[str, list[float]] = {"quiet": [], "control": [], "hookprof": []}
    procs = []
    with tempfile.TemporaryDirectory() as static:
        with urllib.request.urlopen(runner.prof.url, timeout=10) as r:
            control, control_url = serve_copy(r.read(), static)
        procs.append(control)
        loads = {}
        for name, url in (("control", control_url), ("hookprof", runner.prof.url)):
            loads[name] = subprocess.Popen(
                [
                    sys.executable,
                    SCRAPERS,
                    url,
                    "--scrapers",
                    str(args.scrapers),
                    "--seconds",
                    "3600",
                    "--interval",
                    str(args.interval),
                ],
                stdout=subprocess.DEVNULL,
            )
            procs.append(loads[name])
            os.kill(loads[name].pid, signal.SIGSTOP)
        try:
            names = list(means)
            for i in range(args.rounds):
                for name in names[i % 3 :] + names[: i % 3]:
                    for other, proc in loads.items():
                        os.kill(proc.pid, signal.SIGCONT if other == name else signal.SIGSTOP)
                    time.sleep(0.3)  # let the scrapers stop, or get going
                    runner.round_means.clear()
                    runner.timed_round(args.steps)
                    means[name].append(runner.round_means[0])
            renders = metrics_page(runner.prof).renders
        finally:
            for proc in procs:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(timeout=30)
            runner.prof.detach()
    pace = f"every {args.interval:g} s each" if args.interval else "back to back"
    q = statistics.median(means["quiet"])
    print(
        f"# {w.name}, hookprof default: {args.rounds} rounds x {args.steps} steps, "
        f"{args.scrapers} concurrent scrapers ({pace}); the page was rendered {renders} times"
    )
    for name, label in (
        ("quiet", "no scrapes"),
        ("control", "scrapers on a separate server"),
        ("hookprof", "scrapers on hookprof's /metrics"),
    ):
        m = statistics.median(means[name])
        print(f"{label:34s} {m * 1e3:7.2f} ms/step  {m / q:.3f}x")
    return 0


def attacker(args: argparse.Namespace) -> int:
    """The other process of `attack`: open the connections, report, scrape, hold until stdin
    closes."""
    port = int(args.url.rsplit(":", 1)[1].split("/")[0])
    held, failed = [], 0
    for _ in range(args.connections):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if args.attack == "slowloris":
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: ")
            held.append(s)
        except OSError:
            failed += 1
    print(json.dumps({"opened": len(held), "failed": failed}), flush=True)
    sys.stdin.readline()  # the server has been measured with them all open
    context = None
    if args.cafile:
        context = ssl.create_default_context(cafile=args.cafile)
    latencies = []
    for _ in range(10):
        start = time.monotonic()
        try:
            with urllib.request.urlopen(args.url, timeout=10, context=context) as r:
                r.read()
            latencies.append(round(time.monotonic() - start, 4))
        except OSError as exc:
            latencies.append(f"failed after {time.monotonic() - start:.1f} s: {exc!r}"[:120])
        for s in held[:50] if args.attack == "slowloris" else ():
            try:
                s.sendall(b"x")
            except OSError:
                pass
        time.sleep(0.2)
    print(json.dumps({"latencies": latencies}), flush=True)
    sys.stdin.readline()
    return 0


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def attack(args: argparse.Namespace) -> int:
    """Train with hookprof serving; another process (this script, attacker) holds the
    connections: threads and RSS before and during, scrape latencies, steps trained."""
    if args.url:
        return attacker(args)

    import torch

    import hookprof
    from support.models import DeepNet, mse_step, seeded

    fields = {}
    cafile = None
    if args.tls:
        from pathlib import Path

        from support.certs import make_pki

        pki = make_pki(Path(tempfile.mkdtemp()))
        fields = dict(tls_certfile=pki["server"][0], tls_keyfile=pki["server"][1])
        cafile = pki["ca"]
    model = seeded(DeepNet)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    prof = hookprof.attach(model, port=0, **fields)
    stop = threading.Event()
    steps = [0]

    def train():
        while not stop.is_set():
            prof.step(mse_step(model, opt, *model.batch(g)))
            steps[0] += 1
            time.sleep(0.001)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    time.sleep(3)  # the first optimizer step imports for a while
    before = {"threads": os_threads(), "rss_mib": round(rss_mib(), 1)}
    cmd = [
        sys.executable,
        __file__,
        "attack",
        args.attack,
        "--connections",
        str(args.connections),
        "--url",
        prof.url,
    ] + (["--cafile", cafile] if cafile else [])
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        opened = json.loads(child.stdout.readline())
        time.sleep(1.0)
        during = {"threads": os_threads(), "rss_mib": round(rss_mib(), 1)}
        steps_before = steps[0]
        child.stdin.write("\n")
        child.stdin.flush()
        latencies = json.loads(child.stdout.readline())["latencies"]
        steps_during = steps[0] - steps_before
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        stop.set()
        trainer.join(timeout=10)
        prof.detach()
    print(
        json.dumps(
            {
                "attack": args.attack,
                "tls": args.tls,
                "connections": args.connections,
                **opened,
                "before": before,
                "during": during,
                "scrape_latencies_s": latencies,
                "training_steps_during_scrapes": steps_during,
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="measure", required=True)
    load = subparsers.add_parser(
        "scrape-load", help="training slowdown under concurrent scrapers (was scrape_load.py)"
    )
    load.add_argument(
        "--workload", default="mlp", help="one of bench/overhead.py's WORKLOADS (default mlp)"
    )
    load.add_argument("--rounds", type=int, default=20)
    load.add_argument("--steps", type=int, default=5)
    load.add_argument("--scrapers", type=int, default=20)
    load.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="pause between one scraper's scrapes (0: back to back, a stress test)",
    )
    load.set_defaults(run=scrape_load)
    hostile = subparsers.add_parser(
        "attack",
        help="threads, memory and scrape latency under held connections (was endpoint_attack.py)",
    )
    hostile.add_argument("attack", choices=("idle", "slowloris"))
    hostile.add_argument("--connections", type=int, default=500)
    hostile.add_argument("--tls", action="store_true")
    hostile.add_argument("--url", help=argparse.SUPPRESS)  # set for the attacker process
    hostile.add_argument("--cafile", help=argparse.SUPPRESS)
    hostile.set_defaults(run=attack)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
