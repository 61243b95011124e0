"""On a machine with an NVIDIA GPU: the real values behind what CI can only check with
stand-ins (tests/support/fake_gpu.py). Every test here is marked cuda, so it is skipped without a
CUDA device and runs alone with `python -m pytest -m cuda`."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

# deterministic cuBLAS for the bit-identical check below: it must be set before cuBLAS
# starts, and collecting this module comes before any test touches CUDA
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hookprof  # noqa: E402
from support.metrics import parse, samples, scrape  # noqa: E402

pytestmark = pytest.mark.cuda


def wait_for_family(url: str, name: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        families = parse(scrape(url))
        if name in families:
            return families
        time.sleep(0.1)
    raise AssertionError(f"{name} never appeared at {url}")


def test_nvml_gauges_match_nvml_and_nvidia_smi():
    pynvml = pytest.importorskip("pynvml")
    model = nn.Linear(4, 4)
    with hookprof.attach(model, port=0, system_interval_s=0.1) as prof:
        families = wait_for_family(prof.url, "hookprof_gpu_memory_total_bytes")
    totals = samples(families, "hookprof_gpu_memory_total_bytes")
    pynvml.nvmlInit()
    try:
        expected = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            expected[frozenset({"gpu": str(index), "UUID": uuid}.items())] = (
                pynvml.nvmlDeviceGetMemoryInfo(handle).total
            )
    finally:
        pynvml.nvmlShutdown()
    assert totals == expected  # one series per GPU, labels and total memory exact
    # CUDA's view of the same cards (it leaves out what the driver reserves: within 5%)
    by_index = {dict(k)["gpu"]: v for k, v in totals.items()}
    for index in range(torch.cuda.device_count()):
        cuda_total = torch.cuda.get_device_properties(index).total_memory
        assert abs(by_index[str(index)] - cuda_total) <= 0.05 * by_index[str(index)]
    smi = shutil.which("nvidia-smi")
    if smi is not None:  # the labels as a person reads them, and memory in MiB
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        rows = [line.split(", ") for line in out.strip().splitlines()]
        assert {(r[0], r[1]) for r in rows} == {(dict(k)["gpu"], dict(k)["UUID"]) for k in totals}
        for index, _, mib in rows:
            assert abs(by_index[index] / 2**20 - float(mib)) <= 1.0
    utilization = samples(families, "hookprof_gpu_utilization_ratio")
    assert utilization.keys() == totals.keys() and all(
        0.0 <= v <= 1.0 for v in utilization.values()
    )


def test_cuda_memory_gauges_equal_torch_allocator():
    device = torch.device("cuda", 0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hookprof.attach(model, port=0, system_interval_s=0.05) as prof:
        for _ in range(3):
            loss = model(torch.randn(64, 256, device=device)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        key = frozenset({"rank": "0", "device": "0"}.items())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the next system sample after training stopped
            families = parse(scrape(prof.url))
            got = samples(families, "hookprof_cuda_memory_allocated_bytes").get(key)
            if got == allocated:
                break
            time.sleep(0.05)
        assert got == allocated
        assert samples(families, "hookprof_cuda_memory_reserved_bytes")[key] == reserved


EVERY_STEP = dict(sample_every=1, min_sample_interval_s=0.0, activation_interval_s=0.0)
CONFIGS = {  # the settings whose device work differs
    "every step": EVERY_STEP,
    "default": {},  # sampled at step 1, then the every-step checks alone
    "loss check": dict(nonfinite_check="loss"),
    "warn policy": dict(EVERY_STEP, on_nonfinite="warn"),  # polls a device flag each step
}


def _train_mlp(overrides: dict | None, steps: int = 12):
    """An MLP trained on cuda:0 (hookprof attached with `overrides`, or not at all when None);
    the loop runs under set_sync_debug_mode("error"), so any host-device sync hookprof added
    raises."""
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(32, 64, device=device, generator=g) for _ in range(steps)]
    ys = [torch.randn(32, 1, device=device, generator=g) for _ in range(steps)]
    prof = hookprof.attach(model, port=0, **overrides) if overrides is not None else None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in zip(xs, ys):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return model, prof


@pytest.mark.parametrize("config", CONFIGS)
def test_training_on_cuda_adds_no_sync_and_keeps_numerics(config):
    torch.use_deterministic_algorithms(True)
    try:
        plain, _ = _train_mlp(None)
        model, prof = _train_mlp(CONFIGS[config])
    finally:
        torch.use_deterministic_algorithms(False)
    try:
        assert type(prof.timer).__name__ == "CudaEventTimer"
        assert prof.flush(timeout=30)
        snap = prof.snapshot()
    finally:
        prof.detach()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)  # numerics unchanged
    assert snap.step == 12 and snap.internal_errors == 0
    assert snap.nonfinite_steps == {"forward": 0, "loss": 0, "backward": 0}
    if config != "every step":
        return
    # every step sampled: every layer timed both ways, norms those of the last update
    assert snap.sampled_steps == 12
    for index, layer in enumerate(model):
        stats = snap.layers[str(index)]
        assert stats.calls == 1 and stats.forward_seconds > 0 and stats.backward_seconds > 0, stats
        grads = [p.grad for p in layer.parameters()]
        if grads:
            expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
            assert stats.grad_norm == pytest.approx(expected, rel=1e-5)
