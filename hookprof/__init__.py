"""hookprof: a training-time profiler and debugger for PyTorch.

One line, then train as usual:

    import hookprof
    prof = hookprof.attach(model)   # metrics at prof.url

docs/ holds the rest (README.md first).
"""

from hookprof._version import __version__
from hookprof.config import Config
from hookprof.errors import (
    AlreadyAttachedError,
    ConfigError,
    DetachedError,
    HookprofError,
    MetaDeviceError,
    NonFiniteError,
    PortInUseError,
)
from hookprof.profiler import DisabledProfiler, Profiler, attach, detach_all
from hookprof.snapshot import DroppedNonFinite, LayerStats, NonFiniteEvent, Snapshot

__all__ = [
    "__version__",
    "attach",
    "detach_all",
    "Config",
    "Profiler",
    "DisabledProfiler",
    "Snapshot",
    "LayerStats",
    "DroppedNonFinite",
    "NonFiniteEvent",
    "HookprofError",
    "ConfigError",
    "AlreadyAttachedError",
    "PortInUseError",
    "DetachedError",
    "MetaDeviceError",
    "NonFiniteError",
]
