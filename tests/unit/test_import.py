"""Import and attach stay cheap; optional heavy modules are imported only where used."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=120)
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
