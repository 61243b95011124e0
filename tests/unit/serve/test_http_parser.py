"""The metrics server's HTTP parser against requests a proxy and the server could read two
ways (issue 29, item 13): raw bytes on a real socket to a real attached endpoint, the
answers read back whole."""

from __future__ import annotations

import re
import socket
import time

import pytest

import hookprof
from hookprof.serve.httpd import MAX_HEAD_BYTES
from support.models import DeepNet, seeded

SECOND = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture
def port():
    prof = hookprof.attach(
        seeded(DeepNet), port=0, http_header_timeout_s=1.0, http_idle_timeout_s=1.0
    )
    try:
        yield prof.port
    finally:
        prof.detach()


def exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Everything the server sends back to `request` until it closes the connection or
    keeps quiet for its idle timeout (1 s), bounded by `timeout`."""
    got = b""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = s.recv(1 << 16)
            except ConnectionResetError:
                break
            if not data:
                break
            got += data
    return got


def statuses(reply: bytes) -> list[bytes]:
    """The status lines of every response in `reply` (a page ends in "\\n", so the next
    response's status line does not start a "\\r\\n" line)."""
    return re.findall(rb"HTTP/1\.1 \d{3} [^\r\n]*(?=\r\n)", reply)


def test_a_request_without_a_body_is_answered_and_kept_alive(port):
    # the baseline the next tests differ from: two requests on one connection, two answers
    reply = exchange(
        port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n" + SECOND
    )
    assert [s[:12] for s in statuses(reply)] == [b"HTTP/1.1 200"] * 2


def test_duplicate_content_length_is_a_bad_request(port):
    # a proxy honouring the first Content-Length sees one request with a body; the server
    # honoured the last one (0) and answered the body as a second request
    head = (
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: %d\r\nContent-Length: 0\r\n\r\n" % len(SECOND)
    )
    reply = exchange(port, head + SECOND)
    assert statuses(reply) == [b"HTTP/1.1 400 Bad Request"], reply[:300]


@pytest.mark.parametrize("value", [b"abc", b"-1", b"1, 1", "\u00b2".encode("latin-1")])
def test_a_content_length_that_is_not_a_number_is_a_bad_request(port, value):
    reply = exchange(
        port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + value + b"\r\n\r\n"
    )
    assert statuses(reply) == [b"HTTP/1.1 400 Bad Request"], reply[:300]


@pytest.mark.parametrize("size", [20_000, 40_000, 60_000])
def test_a_head_over_the_limit_sent_in_one_piece_gets_431(port, size):
    # whole in one recv(), it used to be parsed and answered 200
    assert size > MAX_HEAD_BYTES
    head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    reply = exchange(port, head)
    assert statuses(reply) == [b"HTTP/1.1 431 Request Header Fields Too Large"], reply[:300]


def test_a_head_just_under_the_limit_is_answered(port):
    filler = MAX_HEAD_BYTES - 200
    reply = exchange(
        port,
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
        + b"a" * filler
        + b"\r\nConnection: close\r\n\r\n",
    )
    assert [s[:12] for s in statuses(reply)] == [b"HTTP/1.1 200"]
