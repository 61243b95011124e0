"""`hookprof top`: the per-layer table of one or more live endpoints (several ranks at once)
in a terminal, refreshed about once a second; `--once` prints it once as plain text.

The live view draws with rich (`pip install 'hookprof[top]'`); keys are read from the
terminal in cbreak mode. Pages are scraped on a thread of their own, so a slow endpoint
never holds up the keys."""

from __future__ import annotations

import dataclasses
import os
import select
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hookprof.serve.server import RECENT_QUERY
from hookprof.view.recent import recent_lines
from hookprof.view.report import history_url, read_history
from hookprof.view.scrape import ScrapeError, fetch, one_line
from hookprof.view.table import (
    COLUMNS,
    RunTable,
    choose,
    filter_rows,
    from_metrics,
    header_line,
    nonfinite_line,
    render,
    row_cells,
    sort_rows,
    with_rates,
)

INSTALL_HINT = "hookprof top needs the 'rich' package: pip install 'hookprof[top]'"

# key -> sort column (pressing the current one again reverses the order)
SORT_KEYS = {
    "s": "share",
    "f": "forward",
    "b": "backward",
    "g": "grad",
    "a": "absmax",
    "d": "dead",
    "x": "nan",
    "n": "layer",
}
HELP = (
    "sort: s share  f fwd  b bwd  g grad norm  a |act| max  d dead  x NaN  n name "
    "(again: reverse)   / filter   q quit"
)


class Scraper:
    """Reads every endpoint, and keeps the previous look at each run for its rates."""

    def __init__(self, urls: Sequence[str], context: Any = None, timeout: float = 5.0):
        self.urls = list(urls)
        self.context = context
        self.timeout = timeout
        self._before: dict[tuple[str, str, int], tuple[float, RunTable]] = {}

    def look(self) -> tuple[list[RunTable], dict[str, str]]:
        """Tables of every run found (with steps/s from the previous look), and the reason
        for each endpoint that could not be read."""
        tables: list[RunTable] = []
        errors: dict[str, str] = {}
        for url in self.urls:
            try:
                text = fetch(url, self.context, self.timeout)
            except ScrapeError as exc:
                errors[url] = exc.reason
                continue
            now = time.monotonic()
            try:
                found = from_metrics(text)
            except ValueError as exc:  # an HTML page, garbage, a rank that is not a number
                errors[url] = (
                    f"what it sent is not a hookprof /metrics page ({one_line(str(exc), 120)})"
                )
                continue
            if not found:
                errors[url] = "no hookprof series on this page (is it a hookprof endpoint?)"
            recent = self._recent(url) if found else {}
            for table in found:
                line = recent_lines(recent.get((table.header.model, table.header.rank), {}))
                if line is not None:
                    table = dataclasses.replace(
                        table, header=dataclasses.replace(table.header, recent=line)
                    )
                key = (url, table.header.model, table.header.rank)
                before = self._before.get(key)
                tables.append(
                    with_rates(
                        table, before[1] if before else None, now - before[0] if before else 0.0
                    )
                )
                self._before[key] = (now, table)
        return tables, errors

    def _recent(self, url: str) -> dict[tuple[str, int], dict[str, Any]]:
        """Each run's last steps, by (model, rank), from the endpoint's /history.json?recent
        (a few KB); none from an endpoint that cannot say (an older hookprof: no line)."""
        try:
            docs = read_history(history_url(url) + "?" + RECENT_QUERY, self.context, self.timeout)
        except (ScrapeError, ValueError):
            return {}
        return {
            (str(d.get("model", "")), int(d.get("rank", 0))): d
            for d in docs
            if isinstance(d.get("recent"), dict)
        }


def run_once(
    scraper: Scraper,
    *,
    interval: float,
    by: str,
    reverse: bool,
    name_filter: str,
    limit: int | None,
    out: Any = sys.stdout,
    err: Any = sys.stderr,
) -> int:
    """Two looks `interval` apart (steps/s needs two), then one plain table. Exit status 1,
    with the reason on stderr, when an endpoint cannot be read."""
    tables, errors = scraper.look()
    if not errors and interval > 0:
        time.sleep(interval)
        tables, errors = scraper.look()
    if errors:
        for url, reason in errors.items():
            print(f"hookprof top: cannot read {url}: {reason}", file=err)
        return 1
    print(render(tables, by=by, reverse=reverse, name_filter=name_filter, limit=limit), file=out)
    return 0


@dataclass
class ViewState:
    """What the person chose, and what the scraper last found."""

    by: str = "share"
    reverse: bool = False
    name_filter: str = ""
    typing: bool = False  # keys go to the filter until Enter or Esc
    quit: bool = False
    tables: list[RunTable] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    looked_at: float | None = None
    urls: list[str] = field(default_factory=list)

    def key(self, ch: str) -> None:
        if self.typing:
            if ch in ("\r", "\n"):
                self.typing = False
            elif ch == "\x1b":
                self.typing, self.name_filter = False, ""
            elif ch in ("\x7f", "\b"):
                self.name_filter = self.name_filter[:-1]
            elif ch.isprintable():
                self.name_filter += ch
            return
        if ch in ("q", "Q", "\x03"):
            self.quit = True
        elif ch == "/":
            self.typing = True
        elif ch == "\x1b":
            self.name_filter = ""
        elif ch in SORT_KEYS:
            column = SORT_KEYS[ch]
            self.reverse = not self.reverse if column == self.by else False
            self.by = column


def view(state: ViewState, height: int) -> Any:
    """The screen as rich renderables: header, table, keys."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    lines: list[Any] = []
    for t in state.tables:
        h = t.header
        lines.append(Text(header_line(h), style="bold"))
        bad = any(h.nonfinite_steps.values()) or h.first_nonfinite is not None
        lines.append(Text("  " + nonfinite_line(h), style="bold red" if bad else "green"))
        if h.stall is not None:  # a rank stuck where it is (docs/stalls.md)
            lines.append(Text("  " + h.stall, style="bold red"))
        if h.recent is not None:  # the last steps, one character each (view/recent.py)
            lines.append(Text("  " + h.recent, style="bold red" if "!" in h.recent else ""))
    for url, reason in state.errors.items():
        lines.append(Text(f"cannot read {url}: {reason}", style="bold red"))
    if state.looked_at is None:
        lines.append(Text("reading " + ", ".join(state.urls) + " ..."))

    rows = [r for t in state.tables for r in t.rows]
    if state.name_filter:
        rows = filter_rows(rows, state.name_filter)
    room = max(height - len(lines) - 7, 3)  # table head and borders, the two footer lines
    ordered = sort_rows(rows, state.by, state.reverse)
    limit = room
    shown, left_out = choose(ordered, limit)
    while len(shown) > room and limit > 0:  # make room for the offenders choose() adds
        limit -= 1
        shown, left_out = choose(ordered, limit)
    shown = shown[:room]
    titles, body = row_cells(shown, several_runs=len(state.tables) > 1)
    sorted_title = COLUMNS[state.by][0]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    for title in titles:
        arrow = ""
        if title == sorted_title:
            arrow = " ^" if (COLUMNS[state.by][2] == state.reverse) else " v"
        left = title in ("rank", "model", "layer", "module", "NaN")
        table.add_column(
            title + arrow,
            justify="left" if left else "right",
            style="bold" if title == sorted_title else None,
            no_wrap=True,
        )
    for row, values in zip(shown, body):
        table.add_row(*values, style="red" if (row.first or row.nonfinite) else None)

    status = f"{len(shown)} of {len(rows)} layers"
    if len(shown) < len(rows):
        status += " (a taller terminal shows more)"
    if state.looked_at is not None:
        status += time.strftime("   read at %H:%M:%S", time.localtime(state.looked_at))
    if state.typing:
        status += f"   filter: {state.name_filter}_  (Enter: keep, Esc: clear)"
    elif state.name_filter:
        status += f"   filter: {state.name_filter!r}  (/ to change, Esc to clear)"
    return Group(*lines, table, Text(status), Text(HELP, style="dim"))


def run_live(scraper: Scraper, *, interval: float, by: str, reverse: bool, name_filter: str) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if not sys.stdin.isatty() or not sys.stdout.isatty():
        print(
            "hookprof top: the live view needs a terminal; use --once for a plain table",
            file=sys.stderr,
        )
        return 2
    import termios
    import tty

    state = ViewState(by=by, reverse=reverse, name_filter=name_filter, urls=scraper.urls)
    lock = threading.Lock()
    changed = threading.Event()
    stop = threading.Event()

    def scrape_loop() -> None:
        while not stop.is_set():
            tables, errors = scraper.look()
            with lock:
                state.tables, state.errors, state.looked_at = tables, errors, time.time()
            changed.set()
            stop.wait(interval)

    console = Console()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    thread = threading.Thread(target=scrape_loop, name="hookprof-top-scraper", daemon=True)
    try:
        tty.setcbreak(fd, termios.TCSANOW)  # keys typed while starting up are kept
        thread.start()
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while not state.quit:
                ready, _, _ = select.select([fd], [], [], 0.1)
                if ready:
                    for ch in os.read(fd, 64).decode(errors="ignore"):
                        with lock:
                            state.key(ch)
                    changed.set()
                if changed.is_set():
                    changed.clear()
                    with lock:
                        live.update(view(state, console.size.height), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return 0
