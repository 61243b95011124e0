"""`hookprof report` and `hookprof top` read endpoints the same way: one set of TLS options
with one wording, a host:port given with --cacert or --cert means https for both, and every
bad input or unreadable endpoint ends in one line saying why, never a traceback.

Driven against hookprof's real TLS endpoint (certificates from tests/support/certs.py) and real
loopback sockets that refuse, or accept and never answer."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.ports import free_port
from support.rendered import Elements, demo_run, line_of, number

COMMANDS = ("top", "report")


def hookprof(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hookprof.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def command_args(command: str, target: str, tmp_path) -> list[str]:
    """What each command needs besides its target to read it once and exit."""
    if command == "top":
        return ["top", "--once", "--interval", "0", target]
    return ["report", target, "-o", str(tmp_path / "run.html")]


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI entry called here (an exception would fail the test): for the many cases
    refused before any connection, where a process per case would only add start-up time."""
    from hookprof.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["hookprof", *args], code, out, err)


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    """The whole of stderr, checked to be the one line a person reads (no traceback)."""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"hookprof {command}: "), result.stderr
    return result.stderr


@pytest.fixture
def tls_run(pki):
    """A trained model whose endpoint serves HTTPS with the test CA's server certificate."""
    cert, key = pki["server"]
    prof, losses = demo_run(steps=12, nan_at=9, tls_certfile=cert, tls_keyfile=key)
    try:
        yield prof, losses, pki
    finally:
        prof.detach()


def test_report_of_host_port_with_cacert_goes_over_https_and_draws_the_live_run(tls_run, tmp_path):
    # on main before this change, `report host:port --cacert` spoke http to the TLS endpoint
    prof, losses, pki = tls_run
    port = prof.url.split(":")[2].split("/")[0]
    assert prof.url.startswith("https://")
    out = tmp_path / "run.html"
    result = hookprof("report", f"127.0.0.1:{port}", "--cacert", pki["ca"], "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"hookprof report: wrote {out} (DemoNet)\n"
    page = out.read_text()
    assert f"from https://127.0.0.1:{port}/history.json" in page
    el = Elements(page)
    (first,) = el.find("p", **{"class": "bad first-offender"})
    assert (first["data-layer"], first["data-step"], first["data-phase"]) == (
        "mlp.0",
        "9",
        "forward",
    )
    (loss_chart,) = el.find("svg", **{"data-kind": "loss"})
    line = line_of(el, loss_chart)
    assert line["data-steps"].split() == [str(s) for s in range(1, 13)]
    for step, (drawn, seen) in enumerate(
        zip((number(v) for v in line["data-values"].split()), losses), start=1
    ):
        if step < 9:  # the losses the training loop computed, read back through TLS
            assert math.isclose(drawn, seen, rel_tol=1e-6), (step, drawn, seen)
        else:
            assert math.isnan(seen) and drawn == math.inf


def test_report_over_mutual_tls_with_host_port(pki, tmp_path):
    cert, key = pki["server"]
    prof, _ = demo_run(
        steps=4, nan_at=0, tls_certfile=cert, tls_keyfile=key, tls_client_cafile=pki["ca"]
    )
    try:
        port = prof.url.split(":")[2].split("/")[0]
        target = f"127.0.0.1:{port}"
        out = tmp_path / "run.html"
        ok = hookprof(
            "report",
            target,
            "--cacert",
            pki["ca"],
            "--cert",
            pki["client"][0],
            "--key",
            pki["client"][1],
            "-o",
            str(out),
        )
        stranger = hookprof(
            "report",
            target,
            "--cacert",
            pki["ca"],
            "--cert",
            pki["stranger"][0],
            "--key",
            pki["stranger"][1],
            "-o",
            str(tmp_path / "no.html"),
        )
    finally:
        prof.detach()
    assert ok.returncode == 0, ok.stderr
    el = Elements(out.read_text())
    (step_chart,) = el.find("svg", **{"data-kind": "step_seconds"})
    assert line_of(el, step_chart)["data-steps"].split() == ["1", "2", "3", "4"]
    assert stranger.returncode == 1
    assert "pass --cert and --key" in one_line_error(stranger, "report")
    assert not (tmp_path / "no.html").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_wrong_ca_is_one_line_saying_what_to_pass(command, tls_run, tmp_path):
    prof, _, pki = tls_run
    port = prof.url.split(":")[2].split("/")[0]
    other_ca = os.path.join(os.path.dirname(pki["ca"]), "other-ca.pem")
    result = hookprof(*command_args(command, f"127.0.0.1:{port}", tmp_path), "--cacert", other_ca)
    assert result.returncode == 1
    page = "metrics" if command == "top" else "history.json"
    line = one_line_error(result, command)
    assert line.startswith(
        f"hookprof {command}: cannot read https://127.0.0.1:{port}/{page}: "
        "its TLS certificate is not trusted ("
    ), line
    assert "pass --cacert with the CA that signed the endpoint's certificate" in line
    assert not (tmp_path / "run.html").exists()


def bad_inputs(pki) -> dict[str, tuple[list[str], str]]:
    """Input the commands refuse before connecting: (arguments after the target, words
    the one-line error must hold)."""
    missing = os.path.join(os.path.dirname(pki["ca"]), "nowhere.pem")
    return {
        "http with --cacert": (
            ["--cacert", pki["ca"]],
            "--cacert and --cert are TLS options, but the URL says http://",
        ),
        "missing CA file": (["--cacert", missing], f"--cacert {missing}: no such file"),
        "CA file not PEM": (
            ["--cacert", pki["client"][1]],
            f"--cacert {pki['client'][1]}: not a PEM CA certificate (",
        ),
        "CA a directory": (
            ["--cacert", os.path.dirname(pki["ca"])],
            f"--cacert {os.path.dirname(pki['ca'])}: not a file",
        ),
        "key without cert": (["--key", pki["client"][1]], "--key needs --cert"),
        "cert without its key": (
            ["--cacert", pki["ca"], "--cert", pki["client"][0]],
            f"--cert {pki['client'][0]}: not a PEM certificate and its private key "
            "(pass --key when the key is not in the --cert file)",
        ),
        "key not the cert's": (
            ["--cacert", pki["ca"], "--cert", pki["client"][0], "--key", pki["stranger"][1]],
            f"--cert {pki['client'][0]} with --key {pki['stranger'][1]}: not a PEM "
            "certificate and its private key (KEY_VALUES_MISMATCH)",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "http with --cacert",
        "missing CA file",
        "CA file not PEM",
        "CA a directory",
        "key without cert",
        "cert without its key",
        "key not the cert's",
    ],
)
@pytest.mark.parametrize("command", COMMANDS)
def test_bad_options_are_refused_in_one_line_before_connecting(
    command, case, pki, tmp_path, capsys
):
    extra, words = bad_inputs(pki)[case]
    # nothing listens on the port: a refusal to connect would be a different message
    target = (
        f"http://127.0.0.1:{free_port()}"
        if case == "http with --cacert"
        else f"127.0.0.1:{free_port()}"
    )
    result = in_process(capsys, *command_args(command, target, tmp_path), *extra)
    assert result.returncode == 2, result.stderr
    assert words in one_line_error(result, command)
    assert not (tmp_path / "run.html").exists()


@pytest.mark.parametrize("target", ["ftp://127.0.0.1:8479", "http://", "127.0.0.1:port"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_url_is_refused_in_one_line(command, target, tmp_path, capsys):
    result = in_process(capsys, *command_args(command, target, tmp_path))
    assert result.returncode == 2, result.stderr
    assert f"not an http(s) endpoint URL: {target!r}" in one_line_error(result, command)


@pytest.mark.parametrize("command", COMMANDS)
def test_refused_and_silent_endpoints_say_so_within_the_timeout(command, tmp_path):
    refused_port = free_port()
    refused = hookprof(
        *command_args(command, f"127.0.0.1:{refused_port}", tmp_path), "--timeout", "2"
    )
    assert refused.returncode == 1
    assert "connection refused: nothing listens there" in one_line_error(refused, command)
    # a socket that listens and never accepts: the kernel completes the connection, nobody answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        quiet = hookprof(
            *command_args(command, f"127.0.0.1:{port}", tmp_path), "--timeout", "1", timeout=60
        )
    assert quiet.returncode == 1
    assert "no answer in time" in one_line_error(quiet, command)
    assert not (tmp_path / "run.html").exists()


@contextlib.contextmanager
def serving(write_body):
    """A plain HTTP server on loopback (not hookprof) whose every answer is 200 with the
    body `write_body(wfile)` writes; stopped whatever happens."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                write_body(self.wfile)
            except OSError:  # the client gave up: what the trickle test wants
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_report_says_when_the_page_is_not_a_hookprof_history(tmp_path):
    with serving(lambda out: out.write(b"<html>some other server</html>")) as target:
        result = hookprof("report", target, "-o", str(tmp_path / "run.html"))
    assert result.returncode == 1
    assert "not a hookprof history" in one_line_error(result, "report")
    assert not (tmp_path / "run.html").exists()


def trickle(out) -> None:
    """A byte every 0.2 s for a minute: each read gets an answer, the whole never comes."""
    for _ in range(300):
        out.write(b" ")
        out.flush()
        time.sleep(0.2)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_endpoint_that_trickles_is_given_up_on_after_the_timeout(command, tmp_path):
    with serving(trickle) as target:
        # the whole body takes a minute: reading it would run into this call's own limit
        result = hookprof(*command_args(command, target, tmp_path), "--timeout", "1", timeout=50)
    assert result.returncode == 1
    assert "the answer took longer than 1 s (--timeout)" in one_line_error(result, command)


def test_report_says_why_it_cannot_write_the_file(tmp_path):
    prof, _ = demo_run(steps=3, nan_at=0)
    try:
        target = prof.url
        result = hookprof("report", target, "-o", str(tmp_path / "no-such-dir" / "run.html"))
    finally:
        prof.detach()
    assert result.returncode == 1
    assert f"cannot write {tmp_path / 'no-such-dir' / 'run.html'}" in one_line_error(
        result, "report"
    )


def tls_options(command: str) -> dict[str, tuple[str | None, str | None]]:
    """--cacert/--cert/--key/--timeout as the command's parser declares them: (metavar, help)."""
    import argparse

    from hookprof import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    {"top": cli.add_top_parser, "report": cli.add_report_parser}[command](sub)
    (command_parser,) = sub.choices.values()
    # argparse keeps a parser's options in _actions only: no public list of them
    return {
        a.option_strings[0]: (a.metavar, a.help)
        for a in command_parser._actions
        if a.option_strings and a.option_strings[0] in ("--cacert", "--cert", "--key", "--timeout")
    }


def test_top_and_report_declare_the_same_tls_options_with_the_same_words():
    top, report = tls_options("top"), tls_options("report")
    assert set(top) == {"--cacert", "--cert", "--key", "--timeout"}
    assert top == report  # the help is a template: the two --timeout defaults differ
    # and what --help prints says the same for both
    helps = {c: hookprof(c, "--help").stdout for c in COMMANDS}
    for option in top:
        words = " ".join(top[option][1].split()).split(" (default")[0]
        for command, text in helps.items():
            assert words in " ".join(text.split()), (command, option)
