from __future__ import annotations

import os
import shutil
import socket
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, avoid: tuple[int, ...] = ()) -> int:
    """A port p with p .. p+n-1 all free right now (per-rank ports are base + LOCAL_RANK)."""
    for _ in range(100):
        base = free_port()
        ports = range(base, base + n)
        if not set(ports) & set(avoid) and all(port_is_free(p) for p in ports[1:]):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def port_is_free(port: int, addr: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
        return True


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


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode()


def parse(text: str) -> dict:
    """name -> Metric (prometheus_client.parser), counters under their name without _total."""
    return {family.name: family for family in text_string_to_metric_families(text)}


ONE_MODEL = object()


def samples(families: dict, name: str, sample_name: str | None = None, *, model=ONE_MODEL) -> dict:
    """{frozenset(labels.items()): value} for one family's samples named sample_name
    ({} when the family is absent). Per-model series carry a `model` label: by default the
    page must hold a single model, whose label is left out of the keys (checked, so two
    models never collapse onto one key); `model="G"` keeps G's samples, label left out;
    `model=None` keeps every label."""
    sample_name = sample_name or name
    if name not in families:
        return {}
    out, models = {}, set()
    for s in families[name].samples:
        if s.name != sample_name:
            continue
        labels = dict(s.labels)
        if model is not None and "model" in labels:
            which = labels.pop("model")
            if model is ONE_MODEL:
                models.add(which)
            elif which != model:
                continue
        out[frozenset(labels.items())] = s.value
    assert len(models) <= 1, f"{name}: models {sorted(models)} on one page: pass model=..."
    return out


# the Debian package that provides each server binary the tests run
DEBIAN_PACKAGE = {
    "prometheus": "prometheus", "promtool": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager", "amtool": "prometheus-alertmanager",
    "docker-compose": "docker-compose", "chromium": "chromium",
    "tmux": "tmux",  # a real terminal for hookprof top's live view
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


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def nvml_driver_present() -> bool:
    """Whether NVML (nvidia-ml-py and an NVIDIA driver) answers on this machine."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def pytest_collection_modifyitems(config, items):
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
    """Certificates made for this test (tests/certs.py): paths of a CA, and (cert, key) of a
    server (127.0.0.1), a client the CA signed, and a stranger another CA signed."""
    pytest.importorskip("cryptography.x509")
    from certs import make_pki

    return make_pki(tmp_path)


@pytest.fixture
def every_step():
    """Config overrides that sample every step, with activation statistics on every one of
    them, and serve on a free port."""
    return dict(port=0, sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)


@pytest.fixture(autouse=True)
def _no_leftover_profilers():
    yield
    from hookprof._testing import live_profilers

    leftovers = live_profilers()
    for prof in leftovers:
        prof.detach()
    assert not leftovers, f"a test left profilers attached: {leftovers}"
