"""Reading hookprof endpoints from outside the training process (`hookprof top`, `hookprof
report`): what a person typed -> URLs, TLS as the server offers it (a CA to trust, a client
certificate for mutual TLS), a bounded fetch, and failures said in words a person can act on.

One set of rules for every command: a bare host:port given with --cacert or --cert means
https; an explicit http:// with them is refused (the options would be silently ignored)."""

from __future__ import annotations

import http.client
import io
import math
import os
import re
import socket
import ssl
import time
from urllib.parse import SplitResult, quote, urljoin, urlsplit, urlunsplit

from hookprof.config import DEFAULT_PORT

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}/metrics"
# what a command reads when given no target: no scheme, so TLS options make it https
DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"


class ScrapeError(Exception):
    """An endpoint could not be read; `reason` says why and what to try."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


_PORT_ALONE = re.compile(r":?\d{1,5}")


def normalize(url: str, tls: bool = False, path: str | None = None) -> str:
    """ "host:port" -> "http://host:port/metrics" ("https" when TLS options were given); a
    host alone gets hookprof's default port (not http's 80), a URL without a path /metrics. `path`:
    the page to read whatever path the URL names
    (`hookprof report` takes the /metrics URL and reads /history.json beside it).
    ValueError for what is not an http(s) endpoint, or an http:// URL given with TLS options."""
    given = url
    if _PORT_ALONE.fullmatch(url):  # `hookprof top 8479`: a port on this machine, not a host
        url = "127.0.0.1:" + url.lstrip(":")
    if "://" not in url:
        url = ("https://" if tls else "http://") + url
    parts = urlsplit(url)
    if not _is_endpoint(parts):
        raise ValueError(
            f"not an http(s) endpoint URL: {given!r} (expected e.g. {DEFAULT_TARGET} or {DEFAULT_URL})"
        )
    if "://" not in given and parts.port is None:  # `hookprof report localhost`
        parts = parts._replace(netloc=f"{parts.netloc}:{DEFAULT_PORT}")
    if tls and parts.scheme == "http":
        # top used to read it in plain http with the options unused: a TLS endpoint then
        # answered "connection reset", the options given looking like the wrong ones
        raise ValueError(
            f"{given}: --cacert and --cert are TLS options, but the URL says http:// "
            f"(write https://, or host:port alone)"
        )
    if path is None:
        return urlunsplit(
            (
                parts.scheme,
                parts.netloc,
                parts.path if parts.path not in ("", "/") else "/metrics",
                parts.query,
                "",
            )
        )
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _is_endpoint(parts: SplitResult) -> bool:
    try:
        _ = parts.port  # a port that is not a number in 0-65535 raises here
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def tls_context(
    cacert: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """Client-side TLS: the system's CAs, or `cacert` (the CA that signed the endpoint's
    certificate); `cert`/`key`: the client certificate an endpoint with
    Config.tls_client_cafile asks for. ValueError naming the option whose file is missing
    or unusable."""
    for option, path in (("--cacert", cacert), ("--cert", cert), ("--key", key)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(
                f"{option} {path}: " + ("not a file" if os.path.exists(path) else "no such file")
            )
    try:
        context = ssl.create_default_context(cafile=cacert)
    except OSError as exc:  # ssl.SSLError is one
        raise ValueError(f"--cacert {cacert}: {_unusable(exc, 'a PEM CA certificate')}") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except OSError as exc:
            given = f"--cert {cert}" + (f" with --key {key}" if key else "")
            hint = "" if key else " (pass --key when the key is not in the --cert file)"
            raise ValueError(
                f"{given}: {_unusable(exc, 'a PEM certificate and its private key')}{hint}"
            ) from None
    return context


def endpoints(
    targets: list[str],
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    path: str | None = None,
) -> tuple[list[str], ssl.SSLContext | None]:
    """What a person typed -> the URLs to read and the TLS context for the https ones
    (`normalize` says how each target becomes a URL). ValueError, in words naming the
    option, for anything that cannot work whatever the endpoint does."""
    if key and not cert:
        raise ValueError("--key needs --cert (the client certificate it belongs to)")
    tls = bool(cacert or cert)
    urls = [normalize(t, tls, path) for t in targets]
    if not any(u.startswith("https:") for u in urls):
        return urls, None
    return urls, tls_context(cacert, cert, key)


MAX_PAGE_BYTES = 64 << 20  # a /metrics page of 3,000 layers is a few MB: more is not one
MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


def fetch(url: str, context: ssl.SSLContext | None = None, timeout: float = 5.0) -> str:
    """The page at `url` as text; ScrapeError on any failure."""
    return fetch_bytes(url, context, timeout).decode("utf-8", errors="replace")


def fetch_bytes(
    url: str,
    context: ssl.SSLContext | None = None,
    timeout: float = 5.0,
    max_bytes: int = MAX_PAGE_BYTES,
) -> bytes:
    """The body at `url`; ScrapeError on any failure. `timeout` bounds the whole fetch
    (connect, TLS handshake, response head and body, redirects): every wait on the network
    is given only the time left, so an endpoint that trickles its answer a byte at a time is
    given up on at `timeout`. Redirects are followed on the same endpoint only; a body over
    `max_bytes` is refused. ValueError for a timeout that is not a positive number."""
    check_timeout(timeout)
    deadline = _Deadline(timeout)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            status, reason, location, body = _get(url, context, deadline, max_bytes)
            if status not in _REDIRECTS or location is None:
                break
            target = urljoin(url, location)
            if _origin(target) != _origin(url):
                raise ScrapeError(
                    url,
                    f"it redirects to another endpoint ({one_line(target)}): "
                    "not followed; give that URL if it is the one meant",
                )
            url = target
        else:
            raise ScrapeError(url, f"more than {MAX_REDIRECTS} redirects (a redirect loop?)")
    except (
        OSError,
        http.client.HTTPException,
        UnicodeError,
    ) as exc:  # UnicodeError: a host IDNA refuses
        raise ScrapeError(url, _why(exc, url, timeout)) from None
    if not 200 <= status < 300:
        raise ScrapeError(url, f"HTTP {status} {one_line(reason)}".rstrip())
    return body


def check_timeout(timeout: float) -> float:
    """`timeout` when it is a positive finite number of seconds; ValueError otherwise (0 put
    the socket in non-blocking mode: "[Errno 115] Operation now in progress")."""
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"--timeout {timeout}: not a positive number of seconds")
    return timeout


class _Deadline:
    """One fetch's time limit; `left()` is what the next wait on the network may take."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return min(left, 86400.0)  # settimeout takes no more than a C timeval holds


class _DeadlineReader(io.RawIOBase):
    """The socket as http.client reads it (response head and body), each read waiting only
    until the fetch's deadline: a socket timeout bounds one wait, not a trickle of them."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client.HTTPResponse needs of a socket: makefile()."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _get(
    url: str, context: ssl.SSLContext | None, deadline: _Deadline, max_bytes: int
) -> tuple[int, str, str | None, bytes]:
    """One GET: (status, reason, Location header, body)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    sock = socket.create_connection((host, port), timeout=deadline.left())
    try:
        if parts.scheme == "https":
            sock.settimeout(deadline.left())  # a total for the handshake (CPython's _ssl)
            sock = (context or ssl.create_default_context()).wrap_socket(sock, server_hostname=host)
        target = quote(
            (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_URL_SAFE
        )
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
            f"User-Agent: hookprof\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n"
        )
        sock.settimeout(deadline.left())  # sendall: the timeout bounds the whole call
        sock.sendall(request.encode("ascii"))
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline), method="GET")  # type: ignore[arg-type]
        try:
            response.begin()  # 100 headers of 64 KiB each at most (http.client)
            chunks, size = [], 0
            while chunk := response.read1(1 << 16):
                size += len(chunk)
                if size > max_bytes:
                    raise ScrapeError(
                        url, f"it sent more than {max_bytes} bytes: not a hookprof page"
                    )
                chunks.append(chunk)
            return (
                response.status,
                response.reason,
                response.getheader("Location"),
                b"".join(chunks),
            )
        finally:
            response.close()
    finally:
        sock.close()


# what a URL's path and query may hold as they are (RFC 3986); anything else is %-escaped
_URL_SAFE = "/?&=%:@!$'()*+,;~-._"


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def one_line(text: str, limit: int = 200) -> str:
    """Foreign text on one line: control characters replaced, cut at `limit`."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _unusable(exc: OSError, expected: str) -> str:
    """Why a certificate or key file could not be loaded: not what was expected (an SSL
    error), or not readable at all (permissions)."""
    if isinstance(exc, ssl.SSLError):  # its reason, when OpenSSL gives one: KEY_VALUES_MISMATCH
        return f"not {expected}" + (f" ({exc.reason})" if exc.reason else "")
    return f"cannot read it ({exc.strerror or exc})"


# what OpenSSL says when the other side answers a ClientHello in plain text
_PLAIN_HTTP_REASONS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST"})


def _why(reason: object, url: str, timeout: float) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (
            f"its TLS certificate is not trusted ({reason.verify_message}): pass --cacert "
            "with the CA that signed the endpoint's certificate"
        )
    if isinstance(reason, ssl.SSLError) and reason.reason in _PLAIN_HTTP_REASONS:
        return "it answers in plain HTTP, not TLS: use http:// (and no --cacert, --cert or --key)"
    if isinstance(reason, ssl.SSLError):
        return (
            f"TLS failed ({reason.reason or reason}): if the endpoint asks for client "
            "certificates (Config.tls_client_cafile), pass --cert and --key"
        )
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: nothing listens there (is the training process running, on that port?)"
    if isinstance(reason, (TimeoutError, ConnectionResetError, http.client.RemoteDisconnected)):
        hint = (
            ""
            if url.startswith("https:")
            else "; if the endpoint serves TLS (Config.tls_certfile), use https:// and --cacert"
        )
        if isinstance(reason, TimeoutError):
            return (
                f"no answer in time: the answer took longer than {timeout:g} s (--timeout)" + hint
            )
        return "the connection was closed without an answer" + hint
    if isinstance(reason, http.client.IncompleteRead):
        return "the connection was closed before the whole answer was sent"
    if isinstance(reason, http.client.HTTPException):
        return f"what it sent is not HTTP ({type(reason).__name__}: {one_line(str(reason), 80)})"
    return one_line(str(reason))
