"""Host, process and GPU statistics, sampled by a background thread.

Sampled at a fixed interval (never per training step) and rendered at scrape time from the
latest immutable sample.

- Process CPU seconds, RSS and open files come from prometheus_client's ProcessCollector
  (`process_*`), which reads /proc; where there is no /proc, `PsutilProcessCollector` exports
  the same names from psutil, so dashboards need one query either way.
- Host CPU utilisation and memory come from psutil (`hookprof_host_*`).
- GPUs come from NVML (the `nvidia-ml-py` package), labelled `gpu` (NVML index) and `UUID`
  exactly as dcgm-exporter spells them, so the two join. Only local rank 0 exports them: one
  series per GPU per node, whatever the number of ranks. Without NVML or a GPU the sampler
  logs one line and exports nothing.
- PyTorch's own CUDA memory (allocated, reserved, peak) per process, once CUDA is in use:
  the sampler never initialises CUDA itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hookprof import metrics_names as names
from hookprof.handles import Handle
from hookprof.metrics_names import family

log = logging.getLogger("hookprof")


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    # None where the device or driver does not report the value (NVML "not supported")
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    energy_joules: float | None = None  # since the driver was loaded


@dataclass(frozen=True, slots=True)
class CudaMemorySample:
    device: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int


@dataclass(frozen=True, slots=True)
class SystemSample:
    host_cpu_utilization_ratio: float | None = None
    host_memory_total_bytes: int | None = None
    host_memory_available_bytes: int | None = None
    gpus: tuple[GpuSample, ...] = ()
    cuda_memory: tuple[CudaMemorySample, ...] = ()


class NvmlReader:
    """Reads every GPU NVML sees. `nvml` is the pynvml module (a test passes a stand-in:
    there is no GPU on CI). `enabled` is False, after one log line, when NVML cannot start."""

    def __init__(self, nvml: Any = None):
        self._nvml = nvml
        self._handles: list[tuple[int, Any, str, str]] = []
        self.enabled = False
        try:
            if self._nvml is None:
                import pynvml  # the nvidia-ml-py package; optional (pip install hookprof[gpu])

                self._nvml = pynvml
            self._nvml.nvmlInit()
            for index in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
                name = _text(self._nvml.nvmlDeviceGetName(handle))
                self._handles.append((index, handle, uuid, name))
        except ImportError:
            log.info(
                "hookprof: GPU metrics off: nvidia-ml-py is not installed (pip install 'hookprof[gpu]')"
            )
            return
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            # str(exc), not exc: a handler that keeps records (pytest's caplog, a notebook's
            # log capture) would keep the traceback, and with its frames the caller's model
            log.info("hookprof: GPU metrics off: NVML unavailable (%s)", str(exc))
            return
        if not self._handles:
            log.info("hookprof: GPU metrics off: NVML sees no GPU")
            self.close()
            return
        self.enabled = True

    def read(self) -> tuple[GpuSample, ...]:
        if not self.enabled:
            return ()
        nv = self._nvml
        out = []
        for index, handle, uuid, name in self._handles:
            rates = _try(nv.nvmlDeviceGetUtilizationRates, handle)
            util = None if rates is None else rates.gpu / 100.0
            mem = _try(nv.nvmlDeviceGetMemoryInfo, handle)
            power_mw = _try(nv.nvmlDeviceGetPowerUsage, handle)
            temp = _try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
            energy_mj = _try(nv.nvmlDeviceGetTotalEnergyConsumption, handle)
            out.append(
                GpuSample(
                    index=index,
                    uuid=uuid,
                    name=name,
                    utilization_ratio=util,
                    memory_used_bytes=None if mem is None else int(mem.used),
                    memory_total_bytes=None if mem is None else int(mem.total),
                    power_watts=None if power_mw is None else power_mw / 1000.0,
                    temperature_celsius=None if temp is None else float(temp),
                    energy_joules=None if energy_mj is None else energy_mj / 1000.0,
                )
            )
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None and (self.enabled or self._handles):
            _try(self._nvml.nvmlShutdown)
        self.enabled = False
        self._handles = []


def read_cuda_memory(cuda: Any) -> tuple[CudaMemorySample, ...]:
    """PyTorch's caching-allocator counters: host-side bookkeeping, no device sync. Read only
    once this process has initialised CUDA (a sampler thread must not be the one to do it)."""
    if not cuda.is_available() or not cuda.is_initialized():
        return ()
    return tuple(
        CudaMemorySample(
            device=d,
            allocated_bytes=int(cuda.memory_allocated(d)),
            reserved_bytes=int(cuda.memory_reserved(d)),
            peak_allocated_bytes=int(cuda.max_memory_allocated(d)),
        )
        for d in range(cuda.device_count())
    )


class SystemSampler:
    """Samples every `interval_s` seconds on a daemon thread; `latest` is swapped whole."""

    def __init__(
        self,
        interval_s: float,
        *,
        gpus: bool,
        nvml: Any = None,
        cuda: Any = None,
        psutil_module: Any = None,
        name: str = "hookprof-system",
    ):
        import psutil

        self._psutil = psutil_module or psutil
        self._cuda = cuda if cuda is not None else cuda_api()
        self._interval_s = interval_s
        self._nvml = NvmlReader(nvml) if gpus else None
        self._psutil.cpu_percent(interval=None)  # the first call only starts the window
        self._stop = threading.Event()
        self.latest = SystemSample()
        # no CPU figure until one interval has passed: a window of microseconds says nothing
        self.latest = dataclasses.replace(self.sample(), host_cpu_utilization_ratio=None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def gpus_enabled(self) -> bool:
        return self._nvml is not None and self._nvml.enabled

    def start(self) -> Handle:
        """Start sampling; returns the handle that stops it."""
        self._thread.start()
        return Handle(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._nvml is not None:
            self._nvml.close()

    def sample(self) -> SystemSample:
        """One reading of everything; a source that fails keeps its previous values."""
        prev = self.latest
        cpu = _try(lambda: self._psutil.cpu_percent(interval=None) / 100.0)
        mem = _try(self._psutil.virtual_memory)
        gpus = _try(self._nvml.read) if self._nvml is not None else ()
        cuda_memory = _try(lambda: read_cuda_memory(self._cuda))
        return SystemSample(
            host_cpu_utilization_ratio=prev.host_cpu_utilization_ratio if cpu is None else cpu,
            host_memory_total_bytes=prev.host_memory_total_bytes if mem is None else int(mem.total),
            host_memory_available_bytes=(
                prev.host_memory_available_bytes if mem is None else int(mem.available)
            ),
            gpus=prev.gpus if gpus is None else gpus,
            cuda_memory=prev.cuda_memory if cuda_memory is None else cuda_memory,
        )

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.latest = self.sample()


# (attribute of GpuSample / CudaMemorySample, its metric)
_GPU_GAUGES = (
    ("utilization_ratio", names.GPU_UTILIZATION_RATIO),
    ("memory_used_bytes", names.GPU_MEMORY_USED_BYTES),
    ("memory_total_bytes", names.GPU_MEMORY_TOTAL_BYTES),
    ("power_watts", names.GPU_POWER_WATTS),
    ("temperature_celsius", names.GPU_TEMPERATURE_CELSIUS),
)
_CUDA_GAUGES = (
    ("allocated_bytes", names.CUDA_MEMORY_ALLOCATED_BYTES),
    ("reserved_bytes", names.CUDA_MEMORY_RESERVED_BYTES),
    ("peak_allocated_bytes", names.CUDA_MEMORY_PEAK_ALLOCATED_BYTES),
)


class SystemCollector(Collector):
    """Renders the sampler's latest reading. Never raises, never touches a device."""

    def __init__(self, get_sample: Callable[[], SystemSample], rank: int):
        self._get_sample = get_sample
        self._rank = str(rank)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            sample = self._get_sample()
            yield from self._host(sample)
            yield from self._gpus(sample.gpus)
            yield from self._cuda(sample.cuda_memory)
        except Exception:  # a scrape must not fail because of one source
            log.debug("hookprof: system collector failed", exc_info=True)

    def _host(self, s: SystemSample) -> Iterator[Metric]:
        for metric, value in (
            (names.HOST_CPU_UTILIZATION_RATIO, s.host_cpu_utilization_ratio),
            (names.HOST_MEMORY_TOTAL_BYTES, s.host_memory_total_bytes),
            (names.HOST_MEMORY_AVAILABLE_BYTES, s.host_memory_available_bytes),
        ):
            if value is not None:
                yield family(metric, value)

    def _gpus(self, gpus: tuple[GpuSample, ...]) -> Iterator[Metric]:
        if not gpus:
            return
        # labelled gpu and UUID as dcgm-exporter spells them (metrics_names.py)
        for attr, metric in _GPU_GAUGES:
            gauge = family(metric)
            for g in gpus:
                value = getattr(g, attr)
                if value is not None:
                    gauge.add_metric([str(g.index), g.uuid], value)
            yield gauge
        energy = family(names.GPU_ENERGY_JOULES_TOTAL)
        for g in gpus:
            if g.energy_joules is not None:
                energy.add_metric([str(g.index), g.uuid], g.energy_joules)
        yield energy

    def _cuda(self, devices: tuple[CudaMemorySample, ...]) -> Iterator[Metric]:
        if not devices:
            return
        for attr, metric in _CUDA_GAUGES:
            gauge = family(metric)
            for d in devices:
                gauge.add_metric([self._rank, str(d.device)], getattr(d, attr))
            yield gauge


class PsutilProcessCollector(Collector):
    """The `process_*` metrics of prometheus_client's ProcessCollector, from psutil, for
    platforms without /proc (macOS). On Linux the ProcessCollector itself is used."""

    def __init__(self, process: Any = None):
        import psutil

        self._process = process or psutil.Process()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = self._process
        cpu = _try(p.cpu_times)
        if cpu is not None:
            yield family(names.PROCESS_CPU_SECONDS_TOTAL, cpu.user + cpu.system)
        mem = _try(p.memory_info)
        if mem is not None:
            yield family(names.PROCESS_RESIDENT_MEMORY_BYTES, mem.rss)
            yield family(names.PROCESS_VIRTUAL_MEMORY_BYTES, mem.vms)
        fds = _try(p.num_fds) if hasattr(p, "num_fds") else None
        if fds is not None:
            yield family(names.PROCESS_OPEN_FDS, fds)
        start = _try(p.create_time)
        if start is not None:
            yield family(names.PROCESS_START_TIME_SECONDS, start)


def cuda_api() -> Any:
    """torch.cuda (a module-level seam: the fake-GPU demo used by the dashboard tests swaps
    it, since no GPU exists on CI)."""
    import torch

    return torch.cuda


def has_proc_fs() -> bool:
    return os.path.exists("/proc/self/stat")


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None if it raised: one missing reading must not cost the others."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
