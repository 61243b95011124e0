"""Reading the run report's documents back from an endpoint's /history.json (for `hookprof
report URL`); the document itself and its JSON form are publish/document.py's."""

from __future__ import annotations

import ssl
from typing import Any

from hookprof.publish.document import from_json
from hookprof.serve.server import HISTORY_PATH
from hookprof.view.scrape import ScrapeError, endpoints, fetch_bytes, normalize

MAX_RESPONSE_BYTES = 64 << 20  # a history is well under a megabyte: more is not one


def history_url(url: str, tls: bool = False) -> str:
    """The /history.json address of an endpoint given as host:port, a base URL, or its
    /metrics URL (scrape.normalize: https for a host:port when `tls`)."""
    return normalize(url, tls, HISTORY_PATH)


def fetch(url: str, *, cacert: str | None = None, cert: str | None = None, key: str | None = None,
          timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every model's document from an endpoint (TLS: the server's CA, and a client
    certificate where it asks for one). ValueError for a bad URL or certificate file,
    ScrapeError when the endpoint cannot be read."""
    (target,), context = endpoints([url], cacert, cert, key, path=HISTORY_PATH)
    return read_history(target, context, timeout)


def read_history(target: str, context: ssl.SSLContext | None, timeout: float) -> list[dict[str, Any]]:
    """The documents at a /history.json URL (scrape.endpoints makes it); ScrapeError when
    it cannot be read or what it sends is not a hookprof history."""
    body = fetch_bytes(target, context, timeout, MAX_RESPONSE_BYTES)
    try:
        return from_json(body)
    except (ValueError, KeyError, TypeError):  # not JSON, or JSON without "models"
        raise ScrapeError(target, "what it sent is not a hookprof history (is it a hookprof endpoint, "
                                  "and one recent enough to serve /history.json?)") from None
