"""The metrics endpoint under hostile clients: threads, memory and scrape latency of a
training process while another process holds N connections open against its /metrics.

    python bench/endpoint_attack.py --attack idle --connections 500 [--tls]
    python bench/endpoint_attack.py --attack slowloris --connections 3000

Attacks: "idle" (connect, send nothing: with TLS, never a ClientHello), "slowloris" (half a
request line, then a byte every few seconds). The training process trains a small model in
its main thread; the attacker process, once its connections are open, scrapes /metrics ten
times on new connections and reports the latencies. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def attacker(args) -> None:
    """The other process: open the connections, report, scrape, hold until stdin closes."""
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


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=("idle", "slowloris"), default="idle")
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--url")  # set for the attacker process
    parser.add_argument("--cafile")
    args = parser.parse_args()
    if args.url:
        attacker(args)
        return 0

    import torch

    import hookprof
    from models import DeepNet, mse_step, seeded

    fields = {}
    cafile = None
    if args.tls:
        from pathlib import Path

        from certs import make_pki

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
    cmd = [sys.executable, __file__, "--attack", args.attack, "--connections", str(args.connections),
           "--url", prof.url] + (["--cafile", cafile] if cafile else [])
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
    print(json.dumps({"attack": args.attack, "tls": args.tls, "connections": args.connections,
                      **opened, "before": before, "during": during,
                      "scrape_latencies_s": latencies, "training_steps_during_scrapes": steps_during}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
