"""The shipped Prometheus rules: valid, and their unit tests pass (promtool)."""

from __future__ import annotations

import subprocess

from support.binaries import promtool
from support.paths import RULES_DIR


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    tool = promtool()
    return subprocess.run([tool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def test_rules_are_valid():
    result = run_promtool("check", "rules", "hookprof-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_pass():
    result = run_promtool("test", "rules", "hookprof-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
