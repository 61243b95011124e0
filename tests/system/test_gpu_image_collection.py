"""The GPU image (bench/gpu_session.sh: torch, transformers, prometheus_client, psutil,
nvidia-ml-py and pytest) lacks the other test extras. One test module that imports such an
extra at module level makes `pytest -m cuda` stop at collection there ("Interrupted: 1 error
during collection"), and a rare GPU session runs none of the cuda tests. tests/system/test_top.py
did (cryptography, through tests/support/certs.py). Here the suite is collected with those extras
hidden, as on that image: every module must collect, and every cuda test must be found."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.paths import ROOT

# dev extras (pyproject.toml) that the GPU image does not have, by import name; PyYAML and
# rich stay: transformers and huggingface_hub depend on them
NOT_ON_THE_GPU_IMAGE = (
    "cryptography",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "grafana_foundation_sdk",
)

# None in sys.modules makes `import x` raise ModuleNotFoundError and importlib.util.find_spec
# answer None, as for a package that is not installed; pytest-timeout (a plugin, which
# pytest's assertion rewriter would look up in sys.modules) is left out with -p no:timeout
COLLECT = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                      "-p", "no:timeout", "tests"]))
"""


def cuda_test_ids(hidden: tuple[str, ...]) -> set[str]:
    """The node ids `pytest -m cuda --collect-only` finds with the packages `hidden`."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", COLLECT, ",".join(hidden)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]  # 2 = interrupted by a collection error
    return set(re.findall(r"^(tests/[^\n]+::[^\n]+)$", out.stdout, re.M))


@pytest.mark.slow
def test_the_suite_collects_without_the_extras_the_gpu_image_lacks():
    pytest.importorskip("lightning")  # the full collection below needs every extra
    everything = cuda_test_ids(())
    on_the_image = cuda_test_ids(NOT_ON_THE_GPU_IMAGE)
    # test_lightning.py skips itself as a module there (importorskip), its cuda test with it
    lightning = {t for t in everything if t.startswith("tests/behaviour/test_lightning.py::")}
    assert len(lightning) == 1
    assert on_the_image == everything - lightning
    files = {t.split("::")[0] for t in everything}
    assert {
        "tests/gpu/test_gpu.py",
        "tests/gpu/test_gpu_nonfinite.py",
        "tests/gpu/test_gpu_host_cost.py",
        "tests/gpu/test_stalls_cuda.py",
        "tests/unit/efficiency/test_efficiency.py",
        "tests/system/test_deploy.py",
        "tests/unit/nonfinite/test_closure_guard.py",
        "tests/gpu/test_step_phases_cuda.py",
    } < files
