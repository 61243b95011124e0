"""Stand-ins for NVML and torch.cuda, for tests only: CI has no GPU and no NVIDIA driver.
They implement just the calls hookprof.serve.system makes, with values a test can change and
check against. Everything else in those tests (sampler thread, collector, HTTP, promtool,
Prometheus) is the real thing."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLErrorNotSupported(NVMLError):
    pass


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, gpus: int = 2, fail_init: bool = False):
        self.fail_init = fail_init
        self.init_calls = 0
        self.shutdown_calls = 0
        self.lock = threading.Lock()
        self.devices = [
            dict(
                uuid=f"GPU-00000000-0000-0000-0000-00000000000{i}",
                name=b"NVIDIA Fake A100",  # NVML returns bytes on older bindings
                util=30 + 10 * i,  # percent
                used=(2 + i) << 30,
                total=80 << 30,
                power_mw=250_000 + 1000 * i,
                temp=50 + i,
                energy_mj=1_000_000 * (i + 1),
                power_supported=True,
            )
            for i in range(gpus)
        ]

    def nvmlInit(self):
        self.init_calls += 1
        if self.fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h]["uuid"]

    def nvmlDeviceGetName(self, h):
        return self.devices[h]["name"]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.devices[h]["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        d = self.devices[h]
        return SimpleNamespace(used=d["used"], total=d["total"], free=d["total"] - d["used"])

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.devices[h]["power_supported"]:
            raise NVMLErrorNotSupported("Not Supported")
        return self.devices[h]["power_mw"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.devices[h]["temp"]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        with self.lock:
            self.devices[h]["energy_mj"] += 5_000  # it only grows, like the real counter
            return self.devices[h]["energy_mj"]


class FakeCuda:
    """torch.cuda's allocator counters for `devices` devices, as if CUDA were in use."""

    def __init__(self, devices: int = 1, initialized: bool = True):
        self.devices = devices
        self.initialized = initialized
        self.allocated = [(1 + d) << 28 for d in range(devices)]

    def is_available(self):
        return self.devices > 0

    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return self.devices

    def memory_allocated(self, d):
        return self.allocated[d]

    def memory_reserved(self, d):
        return self.allocated[d] * 2

    def max_memory_allocated(self, d):
        return self.allocated[d] * 3


# ---- CUDA events and streams (the CudaEventTimer's collaborators)

_clock = itertools.count(1000, 250)  # a fake device clock in microseconds: 250 us per record


class FakeStream:
    """A CUDA stream's ordering: events complete in the order they were recorded on it, and
    only when something waited (the fake device runs only when asked to)."""

    def __init__(self):
        self.recorded = 0
        self.done_upto = 0  # every event with seq <= this has completed

    def complete_upto(self, seq: int) -> None:
        self.done_upto = max(self.done_upto, seq)


class FakeEvent:
    """Mimics torch.cuda.Event(enable_timing=True): record(stream), synchronize(), query(),
    elapsed_time() (which raises, as CUDA does, unless both events have completed)."""

    syncs = 0  # synchronize() calls, all events

    def __init__(self, clock=None):
        self.clock = clock  # microseconds at record(); None: the module's 250 us per record
        self.t_us = None
        self.stream: FakeStream | None = None
        self.seq = 0
        self.synced = False

    def record(self, stream: FakeStream | None = None):
        if stream is None:  # torch.cuda.Event.record() without a stream: the current one
            stream = DEFAULT_STREAM
        self.t_us = next(_clock) if self.clock is None else self.clock()
        self.stream = stream
        stream.recorded += 1
        self.seq = stream.recorded

    def query(self) -> bool:
        return self.seq <= self.stream.done_upto

    def synchronize(self):
        FakeEvent.syncs += 1
        self.synced = True
        self.stream.complete_upto(self.seq)

    def elapsed_time(self, end):  # milliseconds, as CUDA reports them
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (end.t_us - self.t_us) / 1000.0


DEFAULT_STREAM = FakeStream()


class QueuedDevice:
    """One CUDA stream's timing, on a host clock (ns) that a test advances: `launch(ms)`
    enqueues a kernel of that length, which runs once the stream has finished what came
    before and not before the host launched it; an event recorded now is reached by the stream
    at max(busy until, host now), its timestamp. `event()` makes FakeEvents stamped so (a
    CudaEventTimer's event_factory)."""

    def __init__(self, host_clock):
        self.host_clock = host_clock
        self.busy_until_ns = 0

    def launch(self, ms: float) -> None:
        self.busy_until_ns = max(self.busy_until_ns, self.host_clock()) + round(ms * 1_000_000)

    def stream_time_us(self) -> float:
        return max(self.busy_until_ns, self.host_clock()) / 1000

    def event(self) -> FakeEvent:
        return FakeEvent(clock=self.stream_time_us)
