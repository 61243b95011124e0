"""`hookprof top` as a person uses it: against real `hookprof demo` processes (real HTTP and
HTTPS), `--once` for scripts, and the live view in a real terminal (tmux: keys sent, the
screen read back)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid

import pytest

from support.binaries import require_binaries
from support.metrics import parse, samples, scrape
from support.ports import free_port
from support.processes import Processes, hookprof_cmd, read_until
from support.rendered import number
from support.waiting import wait_for

STEPS = 30
NAN_AT = 20


def start_demo(procs: Processes, *extra: str, env: dict | None = None) -> str:
    """A demo that trains STEPS steps, every one sampled, then keeps serving: its figures
    stay put while the tests read them. Returns its URL."""
    proc = procs.start(
        hookprof_cmd(
            "demo",
            "--port",
            str(free_port()),
            "--steps",
            str(STEPS),
            "--sample-every",
            "1",
            "--min-sample-interval",
            "0",
            *extra,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
    )
    line = read_until(proc.stdout, "still serving metrics at", max_lines=400)
    return re.search(r"at (https?://\S+/metrics)", line).group(1)


@pytest.fixture(scope="module")
def demos():
    """Two finished demos: rank 0 whose mlp.0 went NaN at step NAN_AT, and a clean rank 1."""
    procs = Processes()
    try:
        bad = start_demo(procs, "--nan-at-step", str(NAN_AT), "--nan-layer", "mlp.0")
        clean = start_demo(procs, env={"RANK": "1"})
        yield bad, clean
    finally:
        procs.stop_all()


def top(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        hookprof_cmd("top", *args), capture_output=True, text=True, timeout=timeout
    )


def table_rows(text: str) -> list[list[str]]:
    """The cells of the printed table's layer rows (after its title line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "fwd ms/call" in line) + 1
    return [line.split() for line in lines[start:] if line.strip() and not line.startswith("...")]


def test_once_prints_the_table_a_scrape_implies(demos):
    url = demos[0]
    out = top("--once", "--interval", "0.3", url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"rank 0  model DemoNet  step {STEPS} ({STEPS} sampled)  0.0 steps/s"
    )
    assert lines[1].strip() == (
        f"non-finite steps: forward {STEPS - NAN_AT + 1}, backward "
        f"{STEPS - NAN_AT + 1}, loss {STEPS - NAN_AT + 1}; "
        f"first: mlp.0 (forward) at step {NAN_AT} [replay; reproducible]"
    )
    # the same figures computed here from a scrape of the (now idle) endpoint
    f = parse(scrape(url))
    fwd_sum = {
        dict(k)["layer"]: v
        for k, v in samples(
            f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_sum"
        ).items()
    }
    fwd_n = {
        dict(k)["layer"]: v
        for k, v in samples(
            f, "hookprof_layer_forward_seconds", "hookprof_layer_forward_seconds_count"
        ).items()
    }
    bwd_sum = {
        dict(k)["layer"]: v
        for k, v in samples(
            f, "hookprof_layer_backward_seconds", "hookprof_layer_backward_seconds_sum"
        ).items()
    }
    grad = {dict(k)["layer"]: v for k, v in samples(f, "hookprof_layer_gradient_norm").items()}
    steps = samples(f, "hookprof_steps", "hookprof_steps_total")[frozenset({("rank", "0")})]
    step_sum = samples(f, "hookprof_step_duration_seconds", "hookprof_step_duration_seconds_sum")
    mean_step = list(step_sum.values())[0] / steps
    layers_per_step = sum(fwd_sum.values()) / STEPS + sum(bwd_sum.values()) / STEPS
    rows = table_rows(out.stdout)
    assert {r[0] for r in rows} == set(grad) | set(fwd_sum)
    shares = []
    for cells in rows:
        name = cells[0]
        if name not in fwd_sum:
            continue
        assert number(cells[2]) == pytest.approx(
            fwd_sum[name] / fwd_n[name] * 1e3, abs=6e-4, rel=5e-3
        )
        share = (fwd_sum[name] + bwd_sum.get(name, 0.0)) / STEPS / max(mean_step, layers_per_step)
        assert number(cells[4]) == pytest.approx(100 * share, abs=0.06)
        # the run went NaN: rank 0's gradients are NaN since (a NaN prints as "nan")
        if name in grad:
            assert number(cells[5]) == pytest.approx(grad[name], rel=5e-3, nan_ok=True)
        else:  # a layer without parameters
            assert cells[5] == "-"
        shares.append(number(cells[4]))
    assert shares == sorted(shares, reverse=True)  # by share, largest first
    marks = {r[0]: " ".join(r[8:]) for r in rows if len(r) > 8}
    assert re.fullmatch(r"first F\d+ B\d+", marks["mlp.0"])  # the offender, marked


def test_once_reads_several_ranks_sorts_and_filters(demos):
    out = top("--once", "--interval", "0.2", "--sort", "layer", "--filter", "mlp", *demos)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("rank ") and "model" in line]
    assert [lines[i][:21] for i in heads] == ["rank 0  model DemoNet", "rank 1  model DemoNet"]
    # under each rank's header: its non-finite steps, then its last steps one character
    # each (issue 41), as many characters as steps were taken up to 60
    for i in heads:
        assert lines[i + 1].startswith("  non-finite steps")
        first, last = map(int, re.match(r"  steps ([\d,]+)-([\d,]+):", lines[i + 2]).groups())
        drawn = re.search(r"loss \[(.*?)\]", lines[i + 2])[1]
        assert len(drawn) == last - first + 1 <= 60
    assert "non-finite steps: none" in lines[heads[1] + 1]
    rows = table_rows(out.stdout)
    # a rank column, then the layers a-z (ties keep the ranks' order)
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "mlp.0"),
        ("1", "mlp.0"),
        ("0", "mlp.1"),
        ("1", "mlp.1"),
        ("0", "mlp.2"),
        ("1", "mlp.2"),
    ]


def test_once_fails_clearly_when_an_endpoint_is_unreachable(demos):
    port = free_port()
    out = top("--once", "--interval", "0", demos[0], f"127.0.0.1:{port}")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.strip() == (
        f"hookprof top: cannot read http://127.0.0.1:{port}/metrics: "
        "connection refused: nothing listens there (is the training "
        "process running, on that port?)"
    )


def test_top_says_how_to_get_rich_and_that_live_needs_a_terminal(demos):
    no_rich = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['rich'] = None; from hookprof.cli import main; "
            f"sys.exit(main(['top', {demos[0]!r}]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert no_rich.returncode == 2
    assert "pip install 'hookprof[top]'" in no_rich.stderr
    no_tty = top(demos[0])  # stdin and stdout are pipes here
    assert no_tty.returncode == 2 and "use --once" in no_tty.stderr


class Terminal:
    """A tmux server of the test's own (its socket name is unique), killed whatever happens."""

    def __init__(self, command: list[str], width: int = 200, height: int = 50):
        self.tmux = require_binaries("tmux")[0]
        self.socket = f"hookprof-top-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        env = " ".join(
            f"{k}={shlex.quote(v)}"
            for k, v in os.environ.items()
            if k in ("PYTHONPATH", "PATH", "HOME")
        )
        self.run(
            "new-session",
            "-d",
            "-x",
            str(width),
            "-y",
            str(height),
            # COLUMNS/LINES from the caller's environment would override the pane's size
            f"env -u COLUMNS -u LINES {env} TERM=xterm-256color {shlex.join(command)}",
        )

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.tmux, "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )

    def screen(self) -> str:
        return self.run("capture-pane", "-p").stdout

    def keys(self, *keys: str) -> None:
        self.run("send-keys", *keys)

    def alive(self) -> bool:
        return self.run("has-session").returncode == 0

    def close(self) -> None:
        self.run("kill-server")


def screen_rows(screen: str) -> list[list[str]]:
    """The layer rows on the screen: the lines below the column titles, before the status."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if "fwd ms/call" in line) + 2  # titles, rule
    rows = []
    for line in lines[start:]:
        if not line.strip() or " of " in line and "layers" in line:
            break
        rows.append(line.split())
    return rows


def test_live_view_in_a_real_terminal_sorts_filters_and_quits(demos):
    term = Terminal(hookprof_cmd("top", *demos))
    try:
        first = wait_for(
            "the table on the screen",
            lambda: (s := term.screen()) and "mlp.0" in s and "rank 1  model DemoNet" in s and s,
            timeout=60,
        )
        assert f"rank 0  model DemoNet  step {STEPS}" in first
        assert f"first: mlp.0 (forward) at step {NAN_AT}" in first
        assert "share v" in first  # sorted by share, largest first
        rows = screen_rows(first)
        assert len(rows) == 16  # 8 layers on each of 2 ranks
        shares = [number(r[5]) for r in rows if r[5] != "-"]
        assert shares == sorted(shares, reverse=True)

        term.keys("n")  # sort by name
        by_name = wait_for(
            "sorted by name", lambda: (s := term.screen()) and "layer ^" in s and s, timeout=10
        )
        names = [r[1] for r in screen_rows(by_name)]
        assert names == sorted(names) and names[:2] == ["attn", "attn"]

        term.keys("/", "mlp", "Enter")  # filter by name
        filtered = wait_for(
            "filtered to mlp",
            lambda: (s := term.screen()) and "filter: 'mlp'" in s and s,
            timeout=10,
        )
        assert [(r[0], r[1]) for r in screen_rows(filtered)] == [
            ("0", "mlp.0"),
            ("1", "mlp.0"),
            ("0", "mlp.1"),
            ("1", "mlp.1"),
            ("0", "mlp.2"),
            ("1", "mlp.2"),
        ]
        assert "6 of 6 layers" in filtered

        term.keys("q")
        wait_for("top to quit", lambda: not term.alive(), timeout=10)
    finally:
        term.close()


@pytest.fixture(scope="module")
def tls_demo(tmp_path_factory):
    """A finished demo serving HTTPS that asks clients for a certificate (mutual TLS)."""
    # imported here, as conftest's `pki` does: a machine without `cryptography` (the GPU
    # image) must still collect this module, or `pytest -m cuda` stops at collection
    pytest.importorskip("cryptography.x509")
    from support.certs import make_pki

    pki = make_pki(tmp_path_factory.mktemp("pki"))
    procs = Processes()
    try:
        url = start_demo(
            procs,
            env={
                "HOOKPROF_TLS_CERTFILE": pki["server"][0],
                "HOOKPROF_TLS_KEYFILE": pki["server"][1],
                "HOOKPROF_TLS_CLIENT_CAFILE": pki["ca"],
            },
        )
        yield url, pki
    finally:
        procs.stop_all()


def test_once_over_mutual_tls(tls_demo):
    url, pki = tls_demo
    assert url.startswith("https://")
    port = url.split(":")[2].split("/")[0]
    # host:port is enough: TLS options make it https
    out = top(
        "--once",
        "--interval",
        "0.2",
        "--cacert",
        pki["ca"],
        "--cert",
        pki["client"][0],
        "--key",
        pki["client"][1],
        f"127.0.0.1:{port}",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"rank 0  model DemoNet  step {STEPS}")
    assert "mlp.0" in out.stdout


@pytest.mark.parametrize("case", ["wrong CA", "no client certificate", "plain http"])
def test_tls_failures_say_what_to_do(tls_demo, case):
    url, pki = tls_demo
    other_ca = os.path.join(os.path.dirname(pki["ca"]), "other-ca.pem")
    client = ["--cert", pki["client"][0], "--key", pki["client"][1]]
    args = {
        "wrong CA": ["--cacert", other_ca, *client, url],
        "no client certificate": ["--cacert", pki["ca"], url],
        "plain http": [url.replace("https://", "http://")],
    }[case]
    out = top("--once", "--interval", "0", "--timeout", "5", *args)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("hookprof top: cannot read "), out.stderr
    expected = {
        "wrong CA": "its TLS certificate is not trusted (",
        "no client certificate": "pass --cert and --key",
        "plain http": "use https:// and --cacert",
    }[case]
    assert expected in out.stderr, out.stderr


def test_a_short_terminal_still_shows_the_offender():
    """The live view's screen, drawn by rich into a 15-line console: the costliest layers
    that fit, and the first NaN offender however low it sorts."""
    from types import MappingProxyType

    from rich.console import Console

    from hookprof.snapshot import LayerStats, NonFiniteEvent, Snapshot
    from hookprof.view.table import from_snapshot
    from hookprof.view.top import ViewState, view

    layers = {
        f"l{i}": LayerStats(
            name=f"l{i}",
            module="Linear",
            forward_seconds_total=0.001 * (40 - i),
            forward_calls_total=1,
        )
        for i in range(40)
    }
    snap = Snapshot(
        step=10,
        sampled_steps=1,
        step_duration_sum=10.0,
        layers=MappingProxyType(layers),
        first_nonfinite=NonFiniteEvent("l39", "forward", 7),
    )
    console = Console(width=120, height=15, record=True, file=open(os.devnull, "w"))
    console.print(view(ViewState(tables=[from_snapshot(snap)], looked_at=0.0), console.size.height))
    screen = console.export_text()
    names = [line.split()[0] for line in screen.splitlines() if re.match(r"\s*l\d+\s", line)]
    # 15 lines: 2 of header, 7 of table frame and footer, 6 rows: five by share, then l39
    assert names == ["l0", "l1", "l2", "l3", "l4", "l39"]
    assert "6 of 40 layers (a taller terminal shows more)" in screen


def test_once_into_a_pipe_closed_early_exits_quietly(demos):
    """`hookprof top --once | head -2`: the reader leaves before the table is written; top
    exits with 141 (as if killed by SIGPIPE) and no traceback (there was one before)."""
    proc = subprocess.Popen(
        hookprof_cmd("top", "--once", "--interval", "0.2", demos[0]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader is gone before top writes
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141 and "Traceback" not in err, err
