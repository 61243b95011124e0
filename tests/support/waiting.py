"""Polling until something holds, with a bound: the one way tests wait for a thread, a
child process or a server to catch up."""

from __future__ import annotations

import time


def wait_for(
    what: str, check, timeout: float = 10.0, interval: float = 0.2, *, retry_errors: bool = True
):
    """Poll check() every `interval` seconds until it returns something truthy, and return
    that; fail naming `what` after `timeout`. With `retry_errors` an exception from check()
    means "not up yet" (a server still starting) and is named in the failure; without it,
    it ends the wait at once."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:
            if not retry_errors:
                raise
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.1f}s waiting for {what} (last error: {last_error})"
    )
