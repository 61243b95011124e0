"""`hookprof demo` with NVML and torch.cuda replaced by tests/support/fake_gpu.py's stand-ins,
so the GPU panels of the dashboard have series to query on a machine without a GPU. The timer is
the real CUDA-event timer over stand-in events stamped by the host clock, so the series that
exist only with a device timer (hookprof_step_phase_device_seconds) are there, with the host's
figures. Everything else is the real demo: real training, real hookprof, real HTTP server.

    python tests/workers/fake_gpu_demo.py demo --port 8479 ...
"""

import os
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support.fake_gpu, and hookprof from this checkout

import hookprof.profiler  # noqa: E402
import hookprof.serve.system  # noqa: E402
from hookprof.cli import main  # noqa: E402
from hookprof.device.timing import CudaEventTimer  # noqa: E402
from support import fake_gpu  # noqa: E402

sys.modules["pynvml"] = fake_gpu.FakeNvml(gpus=2)
hookprof.serve.system.cuda_api = lambda: fake_gpu.FakeCuda(devices=1)


def host_stamped_event_timer(devices) -> CudaEventTimer:
    stream = fake_gpu.FakeStream()
    return CudaEventTimer(
        event_factory=lambda: fake_gpu.FakeEvent(clock=lambda: time.perf_counter_ns() / 1000),
        current_stream=lambda: stream,
    )


hookprof.profiler.timer_for = host_stamped_event_timer

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
