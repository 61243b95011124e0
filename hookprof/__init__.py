"""hookprof: a training-time profiler and debugger for PyTorch.

    import hookprof
    prof = hookprof.attach(model)   # then train as usual; metrics at prof.url
"""

from ._version import __version__
from .config import Config
from .errors import (
    AlreadyAttachedError,
    ConfigError,
    DetachedError,
    HookprofError,
    NonFiniteError,
    PortInUseError,
)
from .profiler import DisabledProfiler, Profiler, attach, detach_all
from .snapshot import LayerStats, NonFiniteEvent, Snapshot

__all__ = [
    "__version__",
    "attach",
    "detach_all",
    "Config",
    "Profiler",
    "DisabledProfiler",
    "Snapshot",
    "LayerStats",
    "NonFiniteEvent",
    "HookprofError",
    "ConfigError",
    "AlreadyAttachedError",
    "PortInUseError",
    "DetachedError",
    "NonFiniteError",
]
