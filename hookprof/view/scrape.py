"""Reading hookprof endpoints from outside the training process (`hookprof top`, `hookprof
report`): what a person typed -> URLs, TLS as the server offers it (a CA to trust, a client
certificate for mutual TLS), a bounded fetch, and failures said in words a person can act on.

One set of rules for every command: a bare host:port given with --cacert or --cert means
https; an explicit http:// with them is refused (the options would be silently ignored)."""

from __future__ import annotations

import http.client
import os
import ssl
import time
import urllib.error
import urllib.request
from urllib.parse import SplitResult, urlsplit, urlunsplit

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


def normalize(url: str, tls: bool = False, path: str | None = None) -> str:
    """"host:port" -> "http://host:port/metrics" ("https" when TLS options were given); a
    URL without a path gets /metrics. `path`: the page to read whatever path the URL names
    (`hookprof report` takes the /metrics URL and reads /history.json beside it).
    ValueError for what is not an http(s) endpoint, or an http:// URL given with TLS options."""
    given = url
    if "://" not in url:
        url = ("https://" if tls else "http://") + url
    parts = urlsplit(url)
    if not _is_endpoint(parts):
        raise ValueError(f"not an http(s) endpoint URL: {given!r} (expected e.g. {DEFAULT_TARGET} or {DEFAULT_URL})")
    if tls and parts.scheme == "http":
        # top used to read it in plain http with the options unused: a TLS endpoint then
        # answered "connection reset", the options given looking like the wrong ones
        raise ValueError(f"{given}: --cacert and --cert are TLS options, but the URL says http:// "
                         f"(write https://, or host:port alone)")
    if path is None:
        return urlunsplit((parts.scheme, parts.netloc, parts.path if parts.path not in ("", "/") else "/metrics",
                           parts.query, ""))
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _is_endpoint(parts: SplitResult) -> bool:
    try:
        parts.port  # a port that is not a number in 0-65535 raises here
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def tls_context(cacert: str | None = None, cert: str | None = None,
                key: str | None = None) -> ssl.SSLContext:
    """Client-side TLS: the system's CAs, or `cacert` (the CA that signed the endpoint's
    certificate); `cert`/`key`: the client certificate an endpoint with
    Config.tls_client_cafile asks for. ValueError naming the option whose file is missing
    or unusable."""
    for option, path in (("--cacert", cacert), ("--cert", cert), ("--key", key)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{option} {path}: " + ("not a file" if os.path.exists(path) else "no such file"))
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
            raise ValueError(f"{given}: {_unusable(exc, 'a PEM certificate and its private key')}{hint}") from None
    return context


def endpoints(targets: list[str], cacert: str | None = None, cert: str | None = None,
              key: str | None = None, path: str | None = None) -> tuple[list[str], ssl.SSLContext | None]:
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


def fetch(url: str, context: ssl.SSLContext | None = None, timeout: float = 5.0) -> str:
    """The page at `url` as text; ScrapeError on any failure."""
    return fetch_bytes(url, context, timeout).decode("utf-8", errors="replace")


def fetch_bytes(url: str, context: ssl.SSLContext | None = None, timeout: float = 5.0,
                max_bytes: int | None = None) -> bytes:
    """The body at `url`; ScrapeError on any failure. `timeout` bounds each wait on the
    network and, checked between reads, the whole body: an endpoint that trickles its
    answer is given up on after about twice `timeout`, not held on to for ever."""
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(url, timeout=timeout,
                                    context=context if url.startswith("https:") else None) as r:
            chunks, size = [], 0
            while chunk := r.read1(1 << 16):
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise ScrapeError(url, f"it sent more than {max_bytes} bytes: not a hookprof page")
                if time.monotonic() > deadline:
                    raise ScrapeError(url, f"the answer took longer than {timeout:g} s (--timeout)")
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        raise ScrapeError(url, f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise ScrapeError(url, _why(exc.reason, url)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ScrapeError(url, _why(exc, url)) from None


def _unusable(exc: OSError, expected: str) -> str:
    """Why a certificate or key file could not be loaded: not what was expected (an SSL
    error), or not readable at all (permissions)."""
    if isinstance(exc, ssl.SSLError):  # its reason, when OpenSSL gives one: KEY_VALUES_MISMATCH
        return f"not {expected}" + (f" ({exc.reason})" if exc.reason else "")
    return f"cannot read it ({exc.strerror or exc})"


def _why(reason: object, url: str) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"its TLS certificate is not trusted ({reason.verify_message}): pass --cacert "
                "with the CA that signed the endpoint's certificate")
    if isinstance(reason, ssl.SSLError):
        return (f"TLS failed ({reason.reason or reason}): if the endpoint asks for client "
                "certificates (Config.tls_client_cafile), pass --cert and --key")
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: nothing listens there (is the training process running, on that port?)"
    if isinstance(reason, (TimeoutError, ConnectionResetError, http.client.RemoteDisconnected)):
        hint = ("" if url.startswith("https:") else
                "; if the endpoint serves TLS (Config.tls_certfile), use https:// and --cacert")
        if isinstance(reason, TimeoutError):
            return "no answer in time" + hint
        return "the connection was closed without an answer" + hint
    return str(reason)
