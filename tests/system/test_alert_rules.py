"""The shipped Prometheus rules: valid, and their unit tests pass (promtool). The rules'
glob, deploy/prometheus/*.yml, holds rule files only (issue 32: the unit-test file in it made
`promtool check rules deploy/prometheus/*.yml` exit 1)."""

from __future__ import annotations

import glob
import os
import subprocess

from support.binaries import promtool
from support.paths import RULES_DIR


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    tool = promtool()
    return subprocess.run([tool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


def test_every_file_of_the_rules_glob_is_a_valid_rule_file():
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RULES_DIR, "*.yml")))
    assert "hookprof-rules.yml" in files
    result = run_promtool("check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files)


def test_rule_unit_tests_pass():
    tests = glob.glob(os.path.join(RULES_DIR, "tests", "*.test.yml"))
    assert tests
    result = run_promtool("test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)
