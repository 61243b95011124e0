"""Reading hookprof endpoints from outside the training process (`hookprof top`): URLs,
TLS as the server offers it (a CA to trust, a client certificate for mutual TLS), and
failures said in words a person can act on."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit

from .config import DEFAULT_PORT

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}/metrics"


class ScrapeError(Exception):
    """An endpoint could not be read; `reason` says why and what to try."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


def normalize(url: str, tls: bool = False) -> str:
    """"host:port" -> "http://host:port/metrics" ("https" when TLS options were given); a
    URL without a path gets /metrics."""
    if "://" not in url:
        url = ("https://" if tls else "http://") + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) endpoint URL: {url!r} (expected e.g. {DEFAULT_URL})")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def tls_context(cacert: str | None = None, cert: str | None = None,
                key: str | None = None) -> ssl.SSLContext:
    """Client-side TLS: the system's CAs, or `cacert` (the CA that signed the endpoint's
    certificate); `cert`/`key`: the client certificate an endpoint with
    Config.tls_client_cafile asks for."""
    context = ssl.create_default_context(cafile=cacert)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def fetch(url: str, context: ssl.SSLContext | None = None, timeout: float = 5.0) -> str:
    """The page at `url` as text; ScrapeError on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout,
                                    context=context if url.startswith("https:") else None) as r:
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise ScrapeError(url, f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise ScrapeError(url, _why(exc.reason, url)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ScrapeError(url, _why(exc, url)) from None


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
