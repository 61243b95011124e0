"""hookprof's own failures: counted, logged once, and never raised into training."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("hookprof")


class Health:
    """Shared by every hook of one profiler. The first internal error switches the per-layer
    instrumentation off for good (DESIGN.md invariant 3); step counting and the exporter
    keep working so the failure is visible as `hookprof_internal_errors_total`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors = 0
        self.broken = False
        self._logged: set[str] = set()

    def report(self, where: str, exc: BaseException, *, disable: bool = True) -> None:
        with self._lock:
            self.errors += 1
            self.broken = self.broken or disable
            first = where not in self._logged
            self._logged.add(where)
        if first:
            log.error(
                "hookprof: internal error in %s%s; training continues unaffected",
                where,
                "; per-layer instrumentation is now off" if disable else "",
                exc_info=exc,
            )
