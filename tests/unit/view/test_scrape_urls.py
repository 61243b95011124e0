"""What the CLI makes of the URL it is given (view/scrape.py normalize)."""

from __future__ import annotations

import pytest

from hookprof.config import DEFAULT_PORT
from hookprof.view.scrape import normalize


# issue 32: `hookprof report localhost` went to port 80
@pytest.mark.parametrize(
    "given, metrics, history",
    [
        (
            "localhost",
            f"http://localhost:{DEFAULT_PORT}/metrics",
            f"http://localhost:{DEFAULT_PORT}/history.json",
        ),
        (
            "[::1]",
            f"http://[::1]:{DEFAULT_PORT}/metrics",
            f"http://[::1]:{DEFAULT_PORT}/history.json",
        ),
        ("node1:9000", "http://node1:9000/metrics", "http://node1:9000/history.json"),
        # a URL with a scheme says its port (none: the scheme's), as a browser reads it
        ("http://localhost", "http://localhost/metrics", "http://localhost/history.json"),
    ],
)
def test_a_host_alone_gets_hookprofs_default_port(given, metrics, history):
    assert normalize(given) == metrics
    assert normalize(given, path="/history.json") == history


def test_a_host_alone_with_tls_options_is_https_on_the_default_port():
    assert normalize("trainer-0", tls=True) == f"https://trainer-0:{DEFAULT_PORT}/metrics"


# issue 41: `hookprof top --once 8479` read the port as a host name (http://8479:8479)
@pytest.mark.parametrize("given", ["8479", ":8479"])
def test_a_port_alone_is_that_port_on_this_machine(given):
    assert normalize(given) == "http://127.0.0.1:8479/metrics"
    assert normalize(given, tls=True) == "https://127.0.0.1:8479/metrics"


def test_a_port_out_of_range_alone_is_refused():
    with pytest.raises(ValueError, match="not an http"):
        normalize("99999")
