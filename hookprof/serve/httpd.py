"""A small HTTP/1.1 server for one WSGI app that stays responsive whatever clients connect:
one selector thread does all socket work without ever blocking (accept, TLS handshake,
reading request heads, writing responses), a bounded number of short-lived threads call the
app for complete requests, and every phase of a connection has a deadline.

Why not socketserver: its accept loop runs the TLS handshake inside `accept()` (one client
that never sends a ClientHello stops every scrape) and it spends a thread per connection
with no deadline (3,000 half-sent requests held 3,000 threads). Here a connection costs a
file descriptor and a small buffer, whatever it does; a thread only while its response is
made. The surface kept from socketserver (serve_forever, shutdown, server_close,
server_address, socket) is what MetricsServer and its tests use.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import re
import selectors
import socket
import ssl
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("hookprof")

# request line and headers; Prometheus sends about 300 bytes. A longer head gets 431.
MAX_HEAD_BYTES = 16384
_DIGITS = re.compile(r"[0-9]+")  # a Content-Length: ASCII digits only (str.isdigit takes "²")
ACCEPTS_PER_WAKEUP = 64  # a flood of new connections cannot starve the waiting ones
ACCEPT_PAUSE_S = 0.1  # after running out of file descriptors, before accepting again

# values of the `reason` label of hookprof_http_connections_rejected_total
REJECT_REASONS = (
    "too_many_requests",  # http_max_requests answers in flight: 503
    "too_many_connections",  # http_max_connections open: the oldest waiting one closed
    "tls_handshake_timeout",  # no finished TLS handshake within http_header_timeout_s
    "tls_handshake_failed",  # not TLS, or a client certificate missing or not trusted
    "header_timeout",  # no whole request head within http_header_timeout_s
    "bad_request",  # not HTTP, or a head over MAX_HEAD_BYTES: 400 / 431
    "write_timeout",  # the response not taken within http_write_timeout_s
)


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds of one server; Config's http_* fields, which document them."""

    max_requests: int
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float
    write_timeout_s: float

    @classmethod
    def from_config(cls, config: Any) -> Limits:
        return cls(
            config.http_max_requests,
            config.http_max_connections,
            config.http_header_timeout_s,
            config.http_idle_timeout_s,
            config.http_write_timeout_s,
        )


class _Conn:
    """One client connection and what has been read of its next request."""

    __slots__ = ("sock", "buf", "deadline", "handshaken", "idle", "events", "out", "keep")

    def __init__(self, sock: socket.socket, deadline: float, handshaken: bool):
        self.sock = sock
        self.buf = b""
        self.deadline = deadline
        self.handshaken = handshaken
        self.idle = False  # between keep-alive requests: closing it then is routine
        self.events = 0  # what the selector waits for (0: not registered)
        self.out: list[memoryview] | None = None  # the response still to send
        self.keep = False  # ... and whether the connection stays open after it


class Request:
    """A parsed request head."""

    __slots__ = ("method", "target", "version", "headers")

    def __init__(self, method: str, target: str, version: str, headers: dict[str, str]):
        self.method, self.target, self.version, self.headers = method, target, version, headers

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if "close" in connection:
            return False
        # a body we do not read would be taken for the next request: close after answering
        if self.headers.get("content-length", "0") != "0" or "transfer-encoding" in self.headers:
            return False
        return self.version == "HTTP/1.1" or "keep-alive" in connection


def parse_head(head: bytes) -> Request:
    """Request line and headers (without the blank line); ValueError when it is not HTTP."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if (
        len(parts) != 3
        or not parts[0].isalpha()
        or not parts[1]
        or parts[2] not in ("HTTP/1.0", "HTTP/1.1")
    ):
        raise ValueError(f"bad request line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"bad header line {line[:80]!r}")
        name = name.lower()
        if name == "content-length" and (name in headers or not _DIGITS.fullmatch(value.strip())):
            # with the last one winning, "Content-Length: 5" then "...: 0" kept the
            # connection alive and the 5 body bytes were read as the next request
            # (request smuggling through a proxy that honours the first): RFC 9112 6.3
            raise ValueError(f"duplicate or bad Content-Length {value.strip()[:20]!r}")
        headers[name] = value.strip()
    return Request(parts[0], parts[1], parts[2], headers)


def _head(status: str, headers: list[tuple[str, str]], length: int, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
    lines.append(f"Content-Length: {length}")
    lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    return _head(status, [("Content-Type", "text/plain; charset=utf-8")], len(body), False) + body


TOO_MANY_REQUESTS = _plain("503 Service Unavailable", "too many concurrent requests\n")
BAD_REQUEST = _plain("400 Bad Request", "bad request\n")
HEAD_TOO_LARGE = _plain("431 Request Header Fields Too Large", "request head too large\n")
# a TLS ClientHello on a plain-HTTP endpoint (`https://` to it): answered at once, in plain
# HTTP, which the client's TLS reads as a wrong record (an immediate SSL error) where it
# waited for the head's timeout before (13.8 s, issue 41)
TLS_ON_PLAIN = _plain("400 Bad Request", "this endpoint speaks plain HTTP, not TLS: use http://\n")
# a TLS record's first bytes: handshake (22), version 3.x
_TLS_HANDSHAKE = b"\x16\x03"


_WAKE = object()
_live: weakref.WeakSet = weakref.WeakSet()  # servers of this process, for the fork handler
_fork_handler_installed = False


def _close_in_forked_child() -> None:
    # a forked child (DataLoader workers, multiprocessing) must not keep the port: while it
    # held the listening socket the port accepted connections nobody answered, and no new
    # server could bind it. No other thread exists here, and locks held by the parent's
    # threads at fork time stay held, so nothing below takes a lock.
    for server in list(_live):
        server._drop_in_child()


def _install_fork_handler() -> None:
    global _fork_handler_installed
    if not _fork_handler_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_in_forked_child)
        _fork_handler_installed = True


class Server:
    """Listens on (addr, port) and answers with `app` (WSGI) under `limits`; `on_reject(reason)`
    is called for every connection closed for one of REJECT_REASONS."""

    def __init__(
        self,
        addr: str,
        port: int,
        app: Callable,
        limits: Limits,
        *,
        context: ssl.SSLContext | None = None,
        on_reject: Callable[[str], None] = lambda reason: None,
    ):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # connections of past scrapes in TIME_WAIT must not stop a new server binding
            # the port; a socket still listening on it still does (Linux)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        self.scheme = "https" if context is not None else "http"
        self._app = app
        self._limits = limits
        self._context = context
        self._on_reject = on_reject
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        # connections waiting for bytes (handshake, request head, keep-alive), oldest first;
        # only the loop thread touches these
        self._waiting: OrderedDict[_Conn, None] = OrderedDict()
        self._deadlines: list[tuple[float, int, _Conn]] = []  # heap, stale entries skipped
        self._seq = itertools.count()
        self._busy = 0  # connections being answered by a thread
        self._accept_paused_until = 0.0
        # every open client socket, for the fork handler; set add/discard are atomic
        self._open: set[socket.socket] = set()
        # answered (the response, whether to keep the connection), back from the threads
        self._done: deque[tuple[_Conn, list[memoryview] | None, bool]] = deque()
        self._stopping = False
        self._lock = threading.Lock()  # _closed and _done, between answering threads and close
        self._stopped = threading.Event()
        self._stopped.set()  # not running until serve_forever
        self._forked = False
        self._closed = False
        _install_fork_handler()
        _live.add(self)

    # ---------------- the loop thread ----------------

    def serve_forever(self) -> None:
        self._stopped.clear()
        try:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                timeout = 1.0
                if self._deadlines:
                    timeout = min(timeout, max(0.0, self._deadlines[0][0] - now))
                if self._accept_paused_until:
                    timeout = min(timeout, max(0.0, self._accept_paused_until - now))
                    if now >= self._accept_paused_until:
                        self._accept_paused_until = 0.0
                        self._selector.register(self.socket, selectors.EVENT_READ, None)
                for key, _ in self._selector.select(timeout):
                    try:
                        if key.data is None:
                            self._accept()
                        elif key.data is _WAKE:
                            self._take_back()
                        else:
                            self._advance(key.data)
                    except Exception:  # a bug here must cost one connection, not the endpoint
                        log.warning("hookprof metrics server: unexpected error", exc_info=True)
                        if isinstance(key.data, _Conn):
                            self._close(key.data)
        finally:
            for conn in list(self._waiting):
                self._close(conn)
            self._stopped.set()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: stop accepting for a moment
                log.debug("hookprof metrics server: accept failed (%s); pausing", exc)
                self._selector.unregister(self.socket)
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._open.add(sock)
            if len(self._waiting) + self._busy >= self._limits.max_connections:
                if self._waiting:  # the oldest waiting one makes room: a scraper sends its
                    # request at once, a client holding the connection open does not
                    self._reject(next(iter(self._waiting)), "too_many_connections")
                else:
                    self._reject(_Conn(sock, 0.0, True), "too_many_connections")
                    continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._context is not None:
                    # the handshake runs step by step as the client's bytes arrive,
                    # never inside accept()
                    tls = self._context.wrap_socket(
                        sock, server_side=True, do_handshake_on_connect=False
                    )
                    self._open.discard(sock)
                    self._open.add(tls)
                    sock = tls
            except OSError:
                self._close(_Conn(sock, 0.0, True))
                continue
            conn = _Conn(
                sock,
                time.monotonic() + self._limits.header_timeout_s,
                handshaken=self._context is None,
            )
            self._wait(conn, selectors.EVENT_READ)
            self._advance(conn)  # bytes may already be there

    def _advance(self, conn: _Conn) -> None:
        """Move a waiting connection on as far as the bytes it has sent allow."""
        try:
            if not conn.handshaken:
                try:
                    conn.sock.do_handshake()  # type: ignore[attr-defined]  # an SSLSocket here
                except ssl.SSLWantReadError:
                    return self._wait(conn, selectors.EVENT_READ)
                except ssl.SSLWantWriteError:
                    return self._wait(conn, selectors.EVENT_WRITE)
                except (ssl.SSLEOFError, ConnectionError):
                    return self._close(conn)  # gone before a word (port checks, TCP probes)
                except ssl.SSLError as exc:
                    log.debug("hookprof metrics server: TLS handshake failed: %s", exc)
                    return self._reject(conn, "tls_handshake_failed")
                conn.handshaken = True
                self._wait(conn, selectors.EVENT_READ)
            if conn.out is not None and not self._write(conn):
                return
            while True:
                end = conn.buf.find(b"\r\n\r\n")
                if end > MAX_HEAD_BYTES:  # sent in one piece, it arrives whole: still too long
                    return self._reject(conn, "bad_request", HEAD_TOO_LARGE)
                if end >= 0:
                    return self._dispatch(conn, end)
                if len(conn.buf) > MAX_HEAD_BYTES:
                    return self._reject(conn, "bad_request", HEAD_TOO_LARGE)
                try:
                    data = conn.sock.recv(65536)
                except (BlockingIOError, ssl.SSLWantReadError):
                    return self._wait(conn, selectors.EVENT_READ)
                except ssl.SSLWantWriteError:
                    return self._wait(conn, selectors.EVENT_WRITE)
                if not data:
                    return self._close(conn)  # the client is done
                if not conn.buf and self._context is None and data.startswith(_TLS_HANDSHAKE):
                    return self._reject(conn, "bad_request", TLS_ON_PLAIN)
                if conn.idle:  # a new request on a kept-alive connection: its head's deadline
                    conn.idle = False
                    self._set_deadline(conn, time.monotonic() + self._limits.header_timeout_s)
                conn.buf = (conn.buf + data).lstrip(b"\r\n") if not conn.buf else conn.buf + data
        except OSError:
            self._close(conn)

    def _write(self, conn: _Conn) -> bool:
        """Send what the client takes now; True once the response is out and the connection
        waits for its next request."""
        out = conn.out
        while out:
            try:
                # after a want-write, OpenSSL needs the same bytes again: the same slice is
                sent = conn.sock.send(out[0][:65536])
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(conn, selectors.EVENT_WRITE)
                return False
            except ssl.SSLWantReadError:
                self._wait(conn, selectors.EVENT_READ)
                return False
            out[0] = out[0][sent:]
            if not out[0]:
                out.pop(0)
        conn.out = None
        if not conn.keep or self._stopping:
            self._close(conn)
            return False
        conn.idle = not conn.buf
        timeout = self._limits.idle_timeout_s if conn.idle else self._limits.header_timeout_s
        self._set_deadline(conn, time.monotonic() + timeout)
        self._wait(conn, selectors.EVENT_READ)
        return True

    def _dispatch(self, conn: _Conn, end: int) -> None:
        head, conn.buf = conn.buf[:end], conn.buf[end + 4 :]
        try:
            request = parse_head(head)
        except ValueError:
            return self._reject(conn, "bad_request", BAD_REQUEST)
        if self._busy >= self._limits.max_requests:
            return self._reject(conn, "too_many_requests", TOO_MANY_REQUESTS)
        self._unwait(conn)
        self._busy += 1
        try:
            threading.Thread(
                target=self._answer, args=(conn, request), name="hookprof-http-request", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had
            self._busy -= 1
            self._reject(conn, "too_many_requests", TOO_MANY_REQUESTS)

    def _take_back(self) -> None:
        """Connections the answering threads are done with: kept alive, or closed."""
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            conn, out, keep = self._done.popleft()
            self._busy -= 1
            if out is None or self._stopping:
                self._close(conn)
                continue
            # the loop writes: a client reading slowly holds a descriptor, never a thread
            conn.out, conn.keep = out, keep
            conn.deadline = time.monotonic() + self._limits.write_timeout_s
            self._wait(conn, selectors.EVENT_WRITE)
            self._advance(conn)

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(heap)
            if conn.deadline != deadline or conn not in self._waiting:
                continue  # moved on since
            if conn.idle:
                self._close(conn)  # routine end of a kept-alive connection
            elif conn.out is not None:
                self._reject(conn, "write_timeout")
            elif not conn.handshaken:
                self._reject(conn, "tls_handshake_timeout")
            else:
                self._reject(conn, "header_timeout")
        if len(heap) > 4 * len(self._waiting) + 64:  # drop stale entries now and then
            self._deadlines = [(c.deadline, next(self._seq), c) for c in self._waiting]
            heapq.heapify(self._deadlines)

    # ---------------- connection bookkeeping (loop thread) ----------------

    def _wait(self, conn: _Conn, events: int) -> None:
        if conn not in self._waiting:
            self._waiting[conn] = None
            heapq.heappush(self._deadlines, (conn.deadline, next(self._seq), conn))
        if conn.events != events:
            if conn.events:
                self._selector.modify(conn.sock, events, conn)
            else:
                self._selector.register(conn.sock, events, conn)
            conn.events = events

    def _set_deadline(self, conn: _Conn, deadline: float) -> None:
        conn.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, next(self._seq), conn))

    def _unwait(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        if conn.events:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.events = 0

    def _close(self, conn: _Conn) -> None:
        self._unwait(conn)
        self._open.discard(conn.sock)
        try:
            conn.sock.close()
        except OSError:
            pass

    def _reject(self, conn: _Conn, reason: str, reply: bytes | None = None) -> None:
        if reply is not None:
            try:  # one try, never waiting: a client that does not read gets no answer
                conn.sock.send(reply)
            except (OSError, ValueError):
                pass
        self._close(conn)
        self._on_reject(reason)

    # ---------------- answering threads ----------------

    def _answer(self, conn: _Conn, request: Request) -> None:
        out = None
        keep = request.keep_alive
        try:
            status, headers, body = self._call_app(request)
            out = [memoryview(_head(status, headers, len(body), keep))]
            if request.method != "HEAD" and body:
                out.append(memoryview(body))  # the cached page itself, not a copy
        except Exception as exc:  # the app failing: the connection is closed unanswered
            log.debug("hookprof metrics server: request failed: %r", exc)
        finally:
            with self._lock:  # against server_close: every connection is closed by someone
                closed = self._closed
                if not closed:
                    self._done.append((conn, out, keep))
            if closed:
                self._open.discard(conn.sock)
                conn.sock.close()
            else:
                try:
                    self._wake_w.send(b"x")
                except OSError:  # the wake-up buffer is full: the loop is awake anyway
                    pass

    def _call_app(self, request: Request) -> tuple[str, list[tuple[str, str]], bytes]:
        path, _, query = request.target.partition("?")
        environ = {
            "REQUEST_METHOD": request.method,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "SERVER_PROTOCOL": request.version,
            "wsgi.url_scheme": self.scheme,
            "SERVER_NAME": str(self.server_address[0]),
            "SERVER_PORT": str(self.server_address[1]),
        }
        for name, value in request.headers.items():
            environ["HTTP_" + name.upper().replace("-", "_")] = value
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None):
            started[:] = [status, headers]

        body = b"".join(self._app(environ, start_response))
        return started[0], started[1], body

    # ---------------- stopping ----------------

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serve_forever and wait (bounded) until it has returned."""
        if self._forked:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(timeout)

    def server_close(self) -> None:
        """Close the listening socket (the port is free at once) and everything else."""
        if self._forked or self._closed:
            return
        self._stopping = True
        with self._lock:
            self._closed = True
            answered = [conn for conn, _, _ in self._done]
            self._done.clear()
        _live.discard(self)
        self.socket.close()
        # connections still being answered are closed by their threads when they are done
        for conn in answered + list(self._waiting):
            self._close(conn)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _drop_in_child(self) -> None:
        self._forked = True
        # close() only: shutdown() on a shared socket would end the parent's connection
        for sock in (self.socket, self._wake_r, self._wake_w, *list(self._open)):
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._selector.close()
        except (OSError, RuntimeError):
            pass

    @property
    def forked(self) -> bool:
        """True in a forked child: the server is the parent's, it never serves here."""
        return self._forked
