"""Fixtures and markers for every test. Helpers live in tests/support/ (imported as
`support.x`, with tests/ on the path through pytest's `pythonpath`); nothing imports this file."""

from __future__ import annotations

import os

import pytest

from support import settings
from support.hardware import cuda_available

SYSTEM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "system") + os.sep


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    # everything in tests/system/ is slow by its folder: `-m "not slow"` leaves it out
    for item in items:
        if str(item.path).startswith(SYSTEM):
            item.add_marker(pytest.mark.slow)
    # tests marked cuda need a CUDA device: without one they are skipped, so CI (no GPU)
    # runs the whole suite green and `python -m pytest -m cuda` on a GPU box runs them
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def pki(tmp_path):
    """Certificates made for this test (support/certs.py): paths of a CA, and (cert, key) of a
    server (127.0.0.1), a client the CA signed, and a stranger another CA signed."""
    pytest.importorskip("cryptography.x509")
    from support.certs import make_pki

    return make_pki(tmp_path)


@pytest.fixture
def every_step(request):
    """Config overrides that sample every step, with activation statistics on every one of
    them, and serve on a free port. A test or module marked `@pytest.mark.every_step(**more)`
    gets `more` added (update norms on every step, no system metrics ...)."""
    marker = request.node.get_closest_marker("every_step")
    return settings.every_step(**(marker.kwargs if marker else {}))


@pytest.fixture(autouse=True)
def _fresh_capsule_count():
    """capsule_max_count counts per process: each test starts from none written."""
    from hookprof import _testing

    _testing.forget_capsules_written()
    yield
    _testing.forget_capsules_written()


@pytest.fixture(autouse=True)
def _no_leftover_profilers():
    yield
    from hookprof import _testing

    leftovers = _testing.live_profilers()
    for prof in leftovers:
        prof.detach()
    assert not leftovers, f"a test left profilers attached: {leftovers}"
