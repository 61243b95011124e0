"""What hookprof could not see in this set-up: said once in the log and kept for the snapshot.

A feature that cannot run where it is attached (gradient norms when no parameter had a
gradient at a step's end, per-layer timing under torch.compile, step counting without a
step signal) must not leave a `None` or a zero that looks like a measurement: it says so,
once, and `Snapshot.notices` keeps the sentence for whoever reads the numbers.
"""

from __future__ import annotations

import logging
import threading

from hookprof.faults import log


class Notices:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # said from the training thread, read by the publisher
        self._said: dict[str, str] = {}

    def say(self, key: str, text: str, level: int = logging.WARNING) -> None:
        """Log `text` and keep it under `key`, the first time only."""
        with self._lock:
            if key in self._said:
                return
            self._said[key] = text
        log.log(level, "hookprof: %s", text)

    def all(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._said.values())
