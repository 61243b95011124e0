"""Children a test starts: the `hookprof` command as a user runs it, reading a child's
output until a line appears, and stopping every child by PID however the test ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def hookprof_cmd(*args: str) -> list[str]:
    """The `hookprof` command line, run by this interpreter (this checkout's hookprof)."""
    return [sys.executable, "-m", "hookprof.cli", *args]


def read_until(stream, needle: str, max_lines: int = 200) -> str:
    """The first line of a child's output containing `needle`. Other lines (warnings from
    torch in a bare environment, say) are skipped; a child that exits ends the search."""
    for _ in range(max_lines):
        line = stream.readline()
        if not line:
            break
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} never appeared in the child's output")


class Processes:
    """Children started by a test, each stopped by PID however the test ends."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(
            args,
            stdout=kwargs.pop("stdout", subprocess.DEVNULL),
            stderr=kwargs.pop("stderr", subprocess.DEVNULL),
            **kwargs,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
