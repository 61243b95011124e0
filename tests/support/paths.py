"""Where the repository's files are, for tests that read shipped files or start scripts."""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
BENCH = os.path.join(ROOT, "bench")
WORKERS = os.path.join(TESTS, "workers")
DASHBOARD = os.path.join(ROOT, "grafana", "dashboards", "hookprof-training.json")
RULES_DIR = os.path.join(ROOT, "deploy", "prometheus")
RULES = os.path.join(RULES_DIR, "hookprof-rules.yml")


def worker(name: str) -> str:
    """The path of a script in tests/workers/ that a test runs as a process of its own."""
    return os.path.join(WORKERS, name)
