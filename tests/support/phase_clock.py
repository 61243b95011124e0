"""A fake nanosecond clock that a test's loop, model and optimizer advance by known amounts,
and the phase seconds hookprof reports against it (the step phase tests, host and device)."""

from __future__ import annotations

MS = 1_000_000  # ns


class FakeClock:
    def __init__(self):
        self.now = 10 * MS

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms * MS


def phases(prof) -> dict[str, float]:
    """Host milliseconds per step phase, flushed first (every step counted for phases)."""
    prof.flush()
    snap = prof.snapshot()
    assert snap.phase_steps == snap.step
    return {k: round(v * 1e3, 6) for k, v in snap.phase_seconds.items()}
