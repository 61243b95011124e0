"""Where bench/ finds the hookprof it measures and the test suite's helpers: one place, so
that when either moves only this file changes. Every script here imports it first (a
script's own folder is on sys.path, so `import paths` finds this file).

The hookprof under test is HOOKPROF_ROOT's when that is set (compare_versions.alternate sets
it for each version it runs), else this checkout's. The test helpers (stand-in CUDA events,
the lagging device, the op counter, the models, the load scrapers) always come from this
checkout's tests/: they drive hookprof from outside, whichever version is measured.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UNDER_TEST = os.path.realpath(os.environ.get("HOOKPROF_ROOT", ROOT))
TESTS = os.path.join(ROOT, "tests")

# first the hookprof under test: the venv's editable install of another checkout must not win
for _path in (TESTS, HERE, UNDER_TEST):
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)


def hookprof_checkout() -> str:
    """The checkout the imported hookprof comes from; exits when that is not the one under
    test (a wrong import would measure the wrong version without a word)."""
    import hookprof

    found = os.path.dirname(os.path.dirname(os.path.realpath(hookprof.__file__)))
    if found != UNDER_TEST:
        raise SystemExit(
            f"hookprof imported from {found}, not from the checkout under test {UNDER_TEST}"
        )
    return found
