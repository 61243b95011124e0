"""The server and lint binaries tests run (Debian's packages): found on PATH, or the test is
skipped naming what to install; in CI, whose .ci/run installs them, a missing one fails."""

from __future__ import annotations

import os
import shutil

import pytest

# the Debian package that provides each server binary the tests run
DEBIAN_PACKAGE = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "docker-compose": "docker-compose",
    "chromium": "chromium",
    "tmux": "tmux",  # a real terminal for hookprof top's live view
    "victoria-metrics": "victoria-metrics",  # the long-term store of the scale test
}


def require_binaries(*names: str) -> list[str]:
    """Paths of the server binaries a test runs. Where one is missing the test is skipped,
    naming what to install (a GPU box or a laptop need not have Prometheus); in CI, whose
    .ci/run installs them, a missing one is a failure instead."""
    found = [shutil.which(name) for name in names]
    missing = [name for name, path in zip(names, found) if path is None]
    if missing:
        packages = " ".join(sorted({DEBIAN_PACKAGE.get(n, n) for n in missing}))
        reason = f"{', '.join(missing)} not installed (apt-get install {packages})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: .ci/run installs them in CI")
        pytest.skip(reason)
    return found


def promtool() -> str:
    return require_binaries("promtool")[0]
