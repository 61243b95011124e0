"""The `hookprof` command: `hookprof --version`, `hookprof demo`, `hookprof top`, `hookprof report`,
`hookprof replay`."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import signal
import sys
import time
from typing import Any, NoReturn

from hookprof._version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors add the nearest right word (`hookprof tpo`: did you
    mean 'top'?; `--oce`: did you mean --once?). Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        super().error(message + _did_you_mean(self, message))


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """ " (did you mean X?)" for an invalid choice or an unknown option in `message`, else ""."""
    choice = re.search(r"invalid choice: '?([^' ]+)'? \(choose from (.*)\)", message)
    if choice:
        words = [w.strip(" '") for w in choice.group(2).split(",")]
        close = difflib.get_close_matches(choice.group(1), words, n=1)
        return f" (did you mean '{close[0]}'?)" if close else ""
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if unknown:
        options = set(parser._option_string_actions)
        for action in parser._actions:  # the subcommands' options too
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    options.update(sub._option_string_actions)
        hints = []
        for given in unknown.group(1).split():
            if given.startswith("-"):
                close = difflib.get_close_matches(given.split("=")[0], sorted(options), n=1)
                if close:
                    hints.append(f"{given}: did you mean {close[0]}?")
        return f" ({'; '.join(hints)})" if hints else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="hookprof", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hookprof {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="train a small model on CPU and serve its metrics")
    demo.add_argument(
        "--steps", type=int, default=0, help="stop after N steps (0: run until stopped)"
    )
    demo.add_argument(
        "--port",
        type=int,
        default=None,
        help="metrics port (default: Config.port / HOOKPROF_PORT; 0 picks a free one)",
    )
    demo.add_argument("--addr", default=None, help="bind address (default 127.0.0.1)")
    demo.add_argument(
        "--sample-every",
        type=int,
        default=None,
        help="sample every Nth step (default: Config.sample_every)",
    )
    demo.add_argument("--min-sample-interval", type=float, default=None, help="seconds")
    demo.add_argument(
        "--nan-at-step",
        type=int,
        default=0,
        help="make --nan-layer output NaN at this step (1-based)",
    )
    demo.add_argument(
        "--nan-layer", default="mlp.0", help="qualified module name for --nan-at-step and SIGUSR1"
    )
    demo.add_argument(
        "--step-delay", type=float, default=0.0, help="sleep this long per step (seconds)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--table",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="print the per-layer table every SECONDS of training, so one terminal shows it "
        "(default 10; 0: only at the end)",
    )
    demo.add_argument(
        "--exit",
        action="store_true",
        help="exit after the last step (default: keep serving until Ctrl-C)",
    )
    add_top_parser(sub)
    add_report_parser(sub)
    add_replay_parser(sub)
    args = parser.parse_args(argv)
    run = {"demo": run_demo, "top": run_top, "report": run_report, "replay": run_replay}.get(
        args.command
    )
    if run is None:
        parser.print_help()
        return 0
    try:
        return run(args)
    except BrokenPipeError:
        # `hookprof top --once | head`: the reader left; no traceback, and none at exit
        # either (Python flushes stdout then: it goes to /dev/null from here)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a program killed by the closed pipe would


def add_connection_args(parser: argparse.ArgumentParser, timeout: float) -> None:
    """The options of every command that reads endpoints (top, report), in one wording:
    TLS as the endpoint serves it, and how long to wait (hookprof/scrape.py applies them)."""
    tls = parser.add_argument_group(
        "TLS",
        "as the endpoint serves it (Config.tls_certfile; tls_client_cafile for mutual TLS). "
        "With --cacert or --cert a host:port means https; an http:// URL with them is refused.",
    )
    tls.add_argument(
        "--cacert",
        metavar="PEM",
        help="CA certificate(s) that signed the endpoint's TLS certificate (default: the system's CAs)",
    )
    tls.add_argument(
        "--cert",
        metavar="PEM",
        help="client certificate, for endpoints that ask for one (mutual TLS)",
    )
    tls.add_argument(
        "--key", metavar="PEM", help="private key of --cert (when not in the same file)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        metavar="SECONDS",
        help="seconds to wait for each endpoint (default %(default)g)",
    )


def add_top_parser(sub: Any) -> None:
    from hookprof.view.scrape import DEFAULT_TARGET
    from hookprof.view.table import COLUMNS

    top = sub.add_parser(
        "top",
        help="live per-layer view of hookprof endpoints (one per rank)",
        description="Live per-layer table of one or more hookprof endpoints. "
        "The live view needs rich: pip install 'hookprof[top]'.",
    )
    top.add_argument(
        "urls",
        nargs="*",
        metavar="URL",
        help=f"endpoints to read, one per rank (default {DEFAULT_TARGET}); host:port is enough",
    )
    top.add_argument(
        "--once",
        action="store_true",
        help="print one plain table and exit "
        "(no terminal needed; exit status 1 if an endpoint cannot be read)",
    )
    top.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    top.add_argument(
        "--sort", choices=sorted(COLUMNS), default="share", help="column to sort by (default share)"
    )
    top.add_argument("--reverse", action="store_true", help="reverse the sort order")
    top.add_argument(
        "--filter", default="", help="show layers whose name or module type contains this"
    )
    top.add_argument(
        "--limit",
        type=int,
        default=25,
        help="--once: most layers printed, plus any that went NaN/Inf (0: all)",
    )
    add_connection_args(top, timeout=5.0)


def run_top(args: argparse.Namespace) -> int:
    from hookprof.view.scrape import DEFAULT_TARGET, check_timeout, endpoints
    from hookprof.view.top import Scraper, run_live, run_once

    try:
        check_timeout(args.timeout)
        if not (math.isfinite(args.interval) and args.interval >= 0):
            raise ValueError(f"--interval {args.interval}: not a number of seconds >= 0")
        if args.limit < 0:
            raise ValueError(f"--limit {args.limit}: not a number of layers >= 0")
        urls, context = endpoints(args.urls or [DEFAULT_TARGET], args.cacert, args.cert, args.key)
    except ValueError as exc:  # a bad option or URL, a certificate file missing or unusable
        print(f"hookprof top: {exc}", file=sys.stderr)
        return 2
    scraper = Scraper(urls, context, args.timeout)
    if args.once:
        return run_once(
            scraper,
            interval=args.interval,
            by=args.sort,
            reverse=args.reverse,
            name_filter=args.filter,
            limit=args.limit or None,
        )
    return run_live(
        scraper, interval=args.interval, by=args.sort, reverse=args.reverse, name_filter=args.filter
    )


def run_demo(args: argparse.Namespace) -> int:
    import torch

    import hookprof
    from hookprof.config import env_name
    from hookprof.demo import DemoNet, InjectNonFinite
    from hookprof.errors import ConfigError

    torch.manual_seed(args.seed)
    model = DemoNet()
    modules = dict(model.named_modules())
    if args.nan_layer not in modules:
        print(
            f"hookprof demo: no module named {args.nan_layer!r}; "
            f"choose one of {sorted(n for n in modules if n)}",
            file=sys.stderr,
        )
        return 2
    overrides = {
        k: v
        for k, v in (
            ("port", args.port),
            ("addr", args.addr),
            ("sample_every", args.sample_every),
            ("min_sample_interval_s", args.min_sample_interval),
        )
        if v is not None
    }
    # before attach: forward hooks run in registration order, and the fault is meant to
    # look like part of the layer's own computation
    injector = InjectNonFinite(
        modules[args.nan_layer],
        {args.nan_at_step} if args.nan_at_step else set(),
        count_calls=False,
    )
    if env_name("on_nonfinite") not in os.environ:
        overrides["on_nonfinite"] = "warn"  # the demo shows hookprof's one-line diagnosis
    if args.port and env_name("port_conflict") not in os.environ:
        # a port asked for on the command line is where the person will look: one line
        # saying it is taken, not the metrics served somewhere else
        overrides["port_conflict"] = "raise"
    try:
        prof = hookprof.attach(model, **overrides)
    except (ConfigError, OSError) as exc:  # a bad option, the port in use, an address not ours
        print(f"hookprof demo: cannot serve metrics: {exc}", file=sys.stderr)
        return 2
    print(f"hookprof demo: serving metrics at {prof.url}", flush=True)
    if args.nan_at_step:
        print(
            f"hookprof demo: {args.nan_layer} will output NaN at step {args.nan_at_step}",
            flush=True,
        )
    print(
        f"hookprof demo: kill -USR1 {os.getpid()} makes {args.nan_layer} output NaN at the next step",
        flush=True,
    )

    stop = []
    nan_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGUSR1, lambda *_: nan_requested.append(True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    step = 0
    if not (math.isfinite(args.table) and args.table >= 0):
        print(f"hookprof demo: --table {args.table}: not a number of seconds >= 0", file=sys.stderr)
        prof.detach()
        return 2
    next_table = time.monotonic() + args.table
    try:
        try:
            while not stop and (args.steps <= 0 or step < args.steps):
                injector.step = step + 1
                if nan_requested:
                    nan_requested.clear()
                    injector.at.add(step + 1)
                    print(
                        f"hookprof demo: {args.nan_layer} outputs NaN at step {step + 1}",
                        flush=True,
                    )
                tokens, labels = model.batch(generator)
                loss = torch.nn.functional.cross_entropy(model(tokens), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                prof.step(loss)
                step += 1
                if step % 100 == 0:
                    # note: a CPU-GPU sync point, the demo's own progress line every 100 steps
                    print(f"hookprof demo: step {step} loss {loss.item():.4f}", flush=True)
                if args.table and time.monotonic() >= next_table:
                    print(prof.report(), flush=True)  # up to now (a flush: one wait, every few s)
                    next_table = time.monotonic() + args.table
                if args.step_delay:
                    time.sleep(args.step_delay)
        except KeyboardInterrupt:
            stop.append(True)
        print(prof.report(), flush=True)
        if not stop and not args.exit:
            print(
                f"hookprof demo: finished {step} steps; still serving metrics at {prof.url} "
                f"(look: hookprof top {prof.url}); Ctrl-C to stop",
                flush=True,
            )
            while not stop:
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        prof.detach()
    print(f"hookprof demo: stopped after {step} steps", flush=True)
    return 0


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    from hookprof.view.scrape import DEFAULT_TARGET

    report = sub.add_parser(
        "report", help="write the run report (one HTML file) of a running hookprof endpoint"
    )
    report.add_argument(
        "url",
        nargs="?",
        default=DEFAULT_TARGET,
        help="the endpoint: host:port, its base URL or its /metrics URL (default %(default)s)",
    )
    report.add_argument(
        "-o", "--output", default="run.html", help="the HTML file to write (default %(default)s)"
    )
    add_connection_args(report, timeout=10.0)


def run_report(args: argparse.Namespace) -> int:
    from hookprof.files import write_atomic
    from hookprof.serve.server import HISTORY_PATH
    from hookprof.view.report import read_history, render_history
    from hookprof.view.scrape import ScrapeError, check_timeout, endpoints

    try:
        check_timeout(args.timeout)
        (url,), context = endpoints([args.url], args.cacert, args.cert, args.key, path=HISTORY_PATH)
    except ValueError as exc:  # a bad URL, a certificate file missing or unusable
        print(f"hookprof report: {exc}", file=sys.stderr)
        return 2
    try:
        documents = read_history(url, context, args.timeout)
        page = render_history(url, documents)  # before opening the file: no half-written page
    except ScrapeError as exc:
        print(f"hookprof report: cannot read {exc.url}: {exc.reason}", file=sys.stderr)
        return 1
    try:  # whole or not at all: a failed write leaves the previous report as it was
        write_atomic(args.output, page)
    except OSError as exc:
        print(
            f"hookprof report: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    names = ", ".join(d["model"] for d in documents) or "no model"
    print(f"hookprof report: wrote {args.output} ({names})")
    return 0


def add_replay_parser(sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser(
        "replay",
        help="re-run a capsule (Config.capsule_dir) and say whether its NaN/Inf, its replay "
        "check's mismatch, its spike or its update comes back",
        description="Re-run the NaN/Inf of an incident capsule, the forward of a replay check "
        "or a spike, or an optimizer's update: exit status 0 reproduced, 1 not reproduced, 2 "
        "could not load, 3 no verdict (bits that cannot be compared here). The capsule is "
        "unpickled: the model's code must be importable, and only load a capsule you trust.",
    )
    replay.add_argument("capsule", help="the capsule file (hookprof-capsule-*.pt)")
    replay.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run it (default cpu)"
    )
    replay.add_argument(
        "--runs", type=int, default=3, help="runs before saying not reproduced (default 3)"
    )


def run_replay(args: argparse.Namespace) -> int:
    from hookprof.nonfinite.check_capsule import FORM_CHECK
    from hookprof.nonfinite.check_reproduce import replay_check_capsule
    from hookprof.nonfinite.reproduce import NOT_LOADED, replay
    from hookprof.nonfinite.update_capsule import FORM_UPDATE
    from hookprof.nonfinite.update_reproduce import replay_update_capsule

    if args.runs < 1:
        print(f"could not load: --runs {args.runs}: not a number of runs >= 1")
        return NOT_LOADED
    # as `python -m` does: the model's code next to where the person runs it is importable
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return replay(
        args.capsule,
        device=args.device,
        runs=args.runs,
        # (a replay check's mismatch or a spike's batch; an update's inputs)
        forms={FORM_CHECK: replay_check_capsule, FORM_UPDATE: replay_update_capsule},
    )


if __name__ == "__main__":
    sys.exit(main())
