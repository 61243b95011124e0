"""Reading the run report's documents back from an endpoint's /history.json (for `hookprof
report URL`); the document itself and its JSON form are publish/document.py's."""

from __future__ import annotations

import ssl
from typing import Any

from hookprof.publish.document import from_json
from hookprof.serve.server import HISTORY_PATH
from hookprof.view.report_html import render
from hookprof.view.scrape import ScrapeError, endpoints, fetch_bytes, normalize, one_line

MAX_RESPONSE_BYTES = 64 << 20  # a history is well under a megabyte: more is not one


def history_url(url: str, tls: bool = False) -> str:
    """The /history.json address of an endpoint given as host:port, a base URL, or its
    /metrics URL (scrape.normalize: https for a host:port when `tls`)."""
    return normalize(url, tls, HISTORY_PATH)


def fetch(
    url: str,
    *,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """Every model's document from an endpoint (TLS: the server's CA, and a client
    certificate where it asks for one). ValueError for a bad URL or certificate file,
    ScrapeError when the endpoint cannot be read."""
    (target,), context = endpoints([url], cacert, cert, key, path=HISTORY_PATH)
    return read_history(target, context, timeout)


def read_history(
    target: str, context: ssl.SSLContext | None, timeout: float
) -> list[dict[str, Any]]:
    """The documents at a /history.json URL (scrape.endpoints makes it); ScrapeError when
    it cannot be read or what it sends is not a hookprof history."""
    body = fetch_bytes(target, context, timeout, MAX_RESPONSE_BYTES)
    try:
        documents = from_json(body)
    except (
        ValueError,
        KeyError,
        TypeError,
        RecursionError,
    ):  # not JSON, JSON without "models", too deep
        raise _not_history(target) from None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise _not_history(target, '"models" is not a list of documents')
    return documents


def render_history(target: str, documents: list[dict[str, Any]]) -> str:
    """The report page of documents read from `target`; ScrapeError when they are not what
    a hookprof endpoint serves (a field missing or of another type): the page is drawn from
    foreign JSON, and any field it needs may be absent there."""
    try:
        return render(documents, source=target)
    except (
        LookupError,
        TypeError,
        ValueError,
        AttributeError,
        ArithmeticError,
        RecursionError,
    ) as exc:
        raise _not_history(target, f"{type(exc).__name__}: {one_line(str(exc), 80)}") from None


def _not_history(target: str, why: str = "") -> ScrapeError:
    return ScrapeError(
        target,
        "what it sent is not a hookprof history"
        + (f" ({why})" if why else "")
        + " (is it a hookprof endpoint, and one recent enough to serve /history.json?)",
    )
