"""Host, process and GPU metrics through the real exporter. psutil and /proc are real; NVML
and torch.cuda are stand-ins (tests/support/fake_gpu.py) only where a GPU would be needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from prometheus_client import CollectorRegistry, ProcessCollector

import hookprof
import hookprof.serve.system as system
from support.binaries import promtool
from support.fake_gpu import FakeCuda, FakeNvml
from support.hardware import nvml_driver_present
from support.metrics import parse, samples, scrape
from support.waiting import wait_for

GPU_GAUGES = [
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_watts",
    "temperature_celsius",
]


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@pytest.fixture
def fake_nvml(monkeypatch):
    nvml = FakeNvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what `import pynvml` returns
    return nvml


def test_host_and_process_metrics_match_psutil():
    with hookprof.attach(small_model(), port=0, system_interval_s=0.1) as prof:
        # the first CPU figure appears after one interval
        f = wait_for(
            "the first CPU figure",
            lambda: (lambda f: f if "hookprof_host_cpu_utilization_ratio" in f else None)(
                parse(scrape(prof.url))
            ),
            interval=0.05,
            retry_errors=False,
        )
        total = samples(f, "hookprof_host_memory_total_bytes")[frozenset()]
        available = samples(f, "hookprof_host_memory_available_bytes")[frozenset()]
        cpu = samples(f, "hookprof_host_cpu_utilization_ratio")[frozenset()]
        rss = samples(f, "process_resident_memory_bytes")[frozenset()]
        fds = samples(f, "process_open_fds")[frozenset()]
        vm = psutil.virtual_memory()
        me = psutil.Process()
        assert total == vm.total
        assert abs(available - vm.available) < 0.1 * vm.total
        assert 0.0 <= cpu <= 1.0
        assert abs(rss - me.memory_info().rss) < 0.2 * rss  # the process allocates meanwhile
        assert abs(fds - me.num_fds()) <= 5
        # GPU series only where NVML answers (their values: tests/gpu/test_gpu.py, marked cuda)
        assert ("hookprof_gpu_utilization_ratio" in f) == nvml_driver_present()
        if not torch.cuda.is_initialized():  # hookprof itself never initialises CUDA
            assert "hookprof_cuda_memory_allocated_bytes" not in f


def test_system_metrics_off_exports_no_host_or_process_series():
    with hookprof.attach(small_model(), port=0, system_metrics=False) as prof:
        names = set(parse(scrape(prof.url)))
    assert not {n for n in names if n.startswith(("process_", "hookprof_host_", "hookprof_gpu_"))}
    assert "hookprof_steps" in names


def test_psutil_process_collector_agrees_with_prometheus_process_collector():
    # on Linux the exporter uses ProcessCollector (/proc); the psutil one serves macOS.
    ours = CollectorRegistry()
    ours.register(system.PsutilProcessCollector())
    theirs = CollectorRegistry()
    ProcessCollector(registry=theirs)
    for name, rel in (
        ("process_resident_memory_bytes", 0.05),
        ("process_virtual_memory_bytes", 0.05),
        ("process_start_time_seconds", 1e-6),
    ):
        a, b = ours.get_sample_value(name), theirs.get_sample_value(name)
        assert a is not None and b is not None, name
        assert abs(a - b) <= rel * b + 1, (name, a, b)
    assert (
        abs(ours.get_sample_value("process_open_fds") - theirs.get_sample_value("process_open_fds"))
        <= 2
    )
    a = ours.get_sample_value("process_cpu_seconds_total")
    b = theirs.get_sample_value("process_cpu_seconds_total")
    assert abs(a - b) < 0.5, (a, b)


@pytest.mark.skipif(
    nvml_driver_present(), reason="an NVIDIA driver answers here: the no-driver path cannot run"
)
def test_real_nvml_without_a_driver_switches_gpu_metrics_off_with_one_log_line(caplog):
    pytest.importorskip("pynvml")
    with caplog.at_level(logging.INFO, logger="hookprof"):
        sampler = system.SystemSampler(0.1, gpus=True)
        sampler.stop()
    assert not sampler.gpus_enabled
    lines = [r.getMessage() for r in caplog.records if "GPU metrics off" in r.getMessage()]
    assert len(lines) == 1, lines
    assert sampler.latest.gpus == ()


def test_fake_nvml_no_gpu_values_labels_and_units_over_http(fake_nvml):
    fake_nvml.devices[1]["power_supported"] = False  # NVML "not supported" on one device
    with hookprof.attach(small_model(), port=0, system_interval_s=0.05) as prof:
        f = parse(scrape(prof.url))
        for attr in GPU_GAUGES:
            got = samples(f, f"hookprof_gpu_{attr}")
            for i, d in enumerate(fake_nvml.devices):
                key = frozenset({"gpu": str(i), "UUID": d["uuid"]}.items())
                expected = {
                    "utilization_ratio": d["util"] / 100,
                    "memory_used_bytes": d["used"],
                    "memory_total_bytes": d["total"],
                    "power_watts": d["power_mw"] / 1000 if d["power_supported"] else None,
                    "temperature_celsius": d["temp"],
                }[attr]
                if expected is None:
                    assert key not in got, attr  # an unsupported reading is absent, not 0
                else:
                    assert got[key] == pytest.approx(expected), (attr, i)
        # energy: a counter in joules that grows between samples
        key0 = frozenset({"gpu": "0", "UUID": fake_nvml.devices[0]["uuid"]}.items())
        first = samples(f, "hookprof_gpu_energy_joules", "hookprof_gpu_energy_joules_total")[key0]
        assert first >= 1000.0
        fake_nvml.devices[0]["util"] = 97
        later = wait_for(
            "GPU 0 at 97%",
            lambda: (
                lambda f: (
                    f
                    if samples(f, "hookprof_gpu_utilization_ratio").get(
                        frozenset({"gpu": "0", "UUID": fake_nvml.devices[0]["uuid"]}.items())
                    )
                    == 0.97
                    else None
                )
            )(parse(scrape(prof.url))),
            interval=0.05,
            retry_errors=False,
        )
        assert (
            samples(later, "hookprof_gpu_energy_joules", "hookprof_gpu_energy_joules_total")[key0]
            > first
        )
    assert fake_nvml.init_calls == 1 and fake_nvml.shutdown_calls == 1  # detach shuts NVML down


def test_gpu_metrics_switch_and_local_rank(fake_nvml):
    with hookprof.attach(small_model(), port=0, gpu_metrics=False) as prof:
        assert "hookprof_gpu_utilization_ratio" not in parse(scrape(prof.url))
    assert fake_nvml.init_calls == 0  # switched off: NVML is not even opened
    with hookprof.attach(small_model(), port=0, local_rank=1) as prof:
        assert "hookprof_gpu_utilization_ratio" not in parse(scrape(prof.url))
    assert fake_nvml.init_calls == 0  # only local rank 0 exports the node's GPUs
    with hookprof.attach(small_model(), port=0, rank=3, local_rank=0) as prof:
        f = parse(scrape(prof.url))
        assert len(samples(f, "hookprof_gpu_utilization_ratio")) == 2


def test_fake_nvml_no_gpu_failing_init_disables_itself(monkeypatch, caplog):
    nvml = FakeNvml(fail_init=True)
    with caplog.at_level(logging.INFO, logger="hookprof"):
        sampler = system.SystemSampler(0.1, gpus=True, nvml=nvml)
        sampler.stop()
    assert not sampler.gpus_enabled and sampler.latest.gpus == ()
    assert sum("GPU metrics off" in r.getMessage() for r in caplog.records) == 1


def test_fake_cuda_no_gpu_torch_memory_per_device(monkeypatch):
    cuda = FakeCuda(devices=2)
    monkeypatch.setattr(system, "cuda_api", lambda: cuda)
    with hookprof.attach(small_model(), port=0, rank=5) as prof:
        f = parse(scrape(prof.url))
    for attr, factor in (
        ("allocated_bytes", 1),
        ("reserved_bytes", 2),
        ("peak_allocated_bytes", 3),
    ):
        got = samples(f, f"hookprof_cuda_memory_{attr}")
        assert got == {
            frozenset({"rank": "5", "device": str(d)}.items()): float(cuda.allocated[d] * factor)
            for d in range(2)
        }, attr
    # CUDA available but not initialised by the program: nothing read, nothing initialised
    idle = FakeCuda(devices=2, initialized=False)
    assert system.read_cuda_memory(idle) == ()


def test_collector_never_raises_and_a_failing_source_keeps_its_last_values():
    def broken():
        raise RuntimeError("boom")

    registry = CollectorRegistry()
    registry.register(system.SystemCollector(broken, rank=0))
    assert registry.get_sample_value("hookprof_host_memory_total_bytes") is None  # no raise

    class FlakyPsutil:
        calls = 0

        def cpu_percent(self, interval=None):
            return 50.0

        def virtual_memory(self):
            FlakyPsutil.calls += 1
            if FlakyPsutil.calls > 1:
                raise OSError("gone")
            return psutil.virtual_memory()

    sampler = system.SystemSampler(10.0, gpus=False, psutil_module=FlakyPsutil(), cuda=FakeCuda(0))
    first = sampler.latest.host_memory_total_bytes
    again = sampler.sample()
    sampler.stop()
    assert again.host_memory_total_bytes == first == psutil.virtual_memory().total
    assert again.host_cpu_utilization_ratio == 0.5


def test_promtool_accepts_system_metrics(fake_nvml, monkeypatch):
    tool = promtool()
    monkeypatch.setattr(system, "cuda_api", lambda: FakeCuda(devices=1))
    with hookprof.attach(small_model(), port=0, system_interval_s=0.05) as prof:
        time.sleep(0.2)
        text = scrape(prof.url)
    assert "hookprof_gpu_power_watts" in text and "hookprof_cuda_memory_reserved_bytes" in text
    result = subprocess.run(
        [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )


def test_detach_stops_the_system_thread():
    import threading

    prof = hookprof.attach(small_model(), port=0, system_interval_s=0.05)
    assert any(t.name.startswith("hookprof-system") for t in threading.enumerate())
    prof.detach()
    assert not any(t.name.startswith("hookprof-system") for t in threading.enumerate())


def test_system_env_variables(monkeypatch):
    monkeypatch.setenv("HOOKPROF_GPU_METRICS", "0")
    monkeypatch.setenv("HOOKPROF_SYSTEM_INTERVAL_S", "2.5")
    cfg = hookprof.Config.from_env()
    assert cfg.gpu_metrics is False and cfg.system_interval_s == 2.5
    monkeypatch.setenv("HOOKPROF_SYSTEM_INTERVAL_S", "0")
    with pytest.raises(hookprof.ConfigError, match="system_interval_s"):
        hookprof.Config.from_env()
    assert os.environ["HOOKPROF_GPU_METRICS"] == "0"
