"""Import and attach stay cheap; optional heavy modules are imported only where used."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_hookprof_adds_little_beyond_torch():
    # torch first, then hookprof on top of it, in one fresh process
    out = run("""
        import json, sys, time
        import torch
        before = set(sys.modules)
        t = time.perf_counter(); import hookprof; seconds = time.perf_counter() - t
        added = sorted({m.split(".")[0] for m in set(sys.modules) - before})
        print(json.dumps({"seconds": seconds, "added": added}))
    """)
    import json

    result = json.loads(out)
    assert result["seconds"] < 1.0, f"import hookprof took {result['seconds']} s on top of torch"
    # GPU, system and dashboard tooling load where they are used, never at import
    heavy = {"pynvml", "psutil", "grafana_foundation_sdk", "rich", "yaml", "torch"}
    assert not heavy & set(result["added"]), result["added"]
    assert "hookprof" in result["added"]


def test_public_surface():
    import hookprof

    assert set(hookprof.__all__) >= {"attach", "Config", "Profiler", "Snapshot", "LayerStats"}
    for name in hookprof.__all__:
        assert hasattr(hookprof, name), name


# issue 32: every CLI call printed torch's "Failed to initialize NumPy" warning twice where
# numpy was absent; hookprof now depends on numpy (pyproject), so pip installs it
def test_numpy_is_a_dependency_and_the_cli_prints_no_torch_warning():
    import os

    import pytest

    from support.paths import ROOT as root

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in dependencies), dependencies
    out = subprocess.run(
        [sys.executable, "-m", "hookprof.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_the_readme_says_what_tops_live_view_needs():
    import os

    from support.paths import ROOT

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "hookprof[top]" in f.read()
