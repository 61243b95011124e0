"""Writes what hookprof writes, in a process of its own, optionally on a "full disk": with
`--fsize N` the process may not make a file larger than N bytes (RLIMIT_FSIZE, SIGXFSZ
ignored so that the write fails with EFBIG instead of killing the process), which is what a
full disk does to a write, without needing a small file system. Prints one JSON line.

    train DIR [--steps 100] [--bad-from 10]   on_nonfinite="dump" to DIR, backward NaN from step 10
    report PATH                               prof.report(PATH)'s page (view/report_html.write)
    cli PATH                                  `hookprof report -o PATH` (the history read stubbed)
    dumps DIR N [--go FILE]                   N NaN reports of rank 0, step 7, to DIR (after
                                              printing READY, once FILE exists)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time


def full_disk(limit: int | None) -> None:
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def nan_gradients_from(bad_from: int, steps: int, **settings):
    """A profiled run (returned flushed, attached) whose first layer's weight gradient goes
    NaN from `bad_from` on; prof.step ends the steps and nothing updates the weights, so
    every later step is a backward NaN step. test_dump_and_loss_faults runs it in-process."""
    import torch
    from torch import nn

    import hookprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    state = {"step": 0}
    model[0].weight.register_hook(lambda g: g * float("nan") if state["step"] >= bad_from else g)
    prof = hookprof.attach(model, serve=False, **settings)
    for step in range(1, steps + 1):
        state["step"] = step
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        prof.step(loss)
        model.zero_grad()
    prof.flush()
    return prof


def train(directory: str, steps: int, bad_from: int) -> dict:
    prof = nan_gradients_from(bad_from, steps, on_nonfinite="dump", dump_dir=directory)
    snap = prof.snapshot()
    prof.detach()
    return {
        "steps": prof.steps,
        "nonfinite_steps": dict(snap.nonfinite_steps),
        "internal_errors": snap.internal_errors,
        "layers": len(snap.layers),
    }


def report(path: str) -> dict:
    from hookprof.view.report_html import write

    write(path, [])
    return {}


def cli(path: str) -> dict:
    import hookprof.view.report as report_module
    from hookprof.cli import main

    report_module.read_history = lambda url, context, timeout: []  # no server needed
    return {"rc": main(["report", "http://127.0.0.1:9/history.json", "-o", path])}


def dumps(directory: str, n: int, go: str | None) -> dict:
    from hookprof.nonfinite.incident import write_report
    from hookprof.snapshot import NonFiniteEvent, Snapshot

    if go is not None:  # imported: the test starts every writer at once
        print("READY", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.01)

    event, snap = NonFiniteEvent(layer="fc", phase="forward", step=7), Snapshot(step=7)
    failed, paths = [], set()
    for _ in range(n):
        try:
            paths.add(write_report(event, snap, directory, 0))
        except OSError as exc:
            failed.append(repr(exc))
    return {
        "failed": len(failed),
        "first_failure": failed[:1],
        "paths": sorted(paths),
        "pid": os.getpid(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("train", "report", "cli", "dumps"))
    parser.add_argument("path")
    parser.add_argument("n", type=int, nargs="?", default=1)
    parser.add_argument("--fsize", type=int, default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bad-from", type=int, default=10)
    parser.add_argument("--go", default=None)
    args = parser.parse_args()
    full_disk(args.fsize)
    try:
        if args.what == "train":
            out = train(args.path, args.steps, args.bad_from)
        elif args.what == "report":
            out = report(args.path)
        elif args.what == "cli":
            out = cli(args.path)
        else:
            out = dumps(args.path, args.n, args.go)
        out["error"] = None
    except OSError as exc:
        out = {"error": exc.errno}
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
