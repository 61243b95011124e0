"""Catching, on the CPU, every place where hookprof would make the training thread wait for a GPU.

On CUDA a host-device synchronisation is an ATen op (or tensor method) whose result the host
needs before it can go on: a value read (`.item()`, `bool(t)`, `if t:`, `float(t)`), an
output whose shape depends on the data (`nonzero`, boolean-mask indexing, `unique`), or a
blocking copy to the host (`.cpu()`, `.tolist()`). On the CPU these cost nothing, so a test
on the CPU never notices one; `torch.cuda.set_sync_debug_mode("error")` needs a GPU.
`SyncWatch` records them on the CPU instead, on the thread that entered it (a
TorchDispatchMode and a TorchFunctionMode are both thread-local; autograd carries them into
backward hooks), under `support/lagging_device.py`, which makes hookprof take its device code
paths on the CPU.

Which ops wait on CUDA (the sources read):
- ATen's own operator tags (torchgen/packaged/ATen/native/tags.yaml, read at import from
  `op.tags`): `data_dependent_output` ("a non-Tensor output whose value is dependent on the
  data": `_local_scalar_dense`, `item`) and `dynamic_output_shape` (`nonzero`,
  `masked_select`, `_unique`, `_unique2`, `unique_dim`, `unique_consecutive`, `bincount`,
  `index.Tensor`, `repeat_interleave.Tensor`, `one_hot`): the host must learn a count from
  the device to allocate the output. `index.Tensor` waits only with a boolean index,
  `repeat_interleave.Tensor` only without `output_size`, `one_hot` only without
  `num_classes` (a `max()` read), so those are judged by their arguments.
- Any other op that returns a Python number or bool computed from tensor data (metadata ops
  excluded): `equal` (aten/src/ATen/native/cuda/Equal.cpp: `eq(self, src).all().item()`),
  `allclose`, `is_nonzero`.
- `index_put_` / `index_put` / `_index_put_impl_` with a boolean index (`x[mask] = v`):
  the mask goes through `nonzero`; shown by the script of pytorch/pytorch#62092, the PR
  that added set_sync_debug_mode.
- `masked_fill.Tensor` with a 0-d value tensor on the device: aten/src/ATen/native/cuda/
  Indexing.cu, `masked_fill__cuda(self, mask, value.item())` (fine with a CPU value).
- Python-level reads that dispatch nothing on a CPU tensor, seen through the function mode:
  `Tensor.tolist`, `.numpy`, `.__array__`, `.cpu()`, `.to("cpu")` without non_blocking
  (a blocking device-to-host copy on CUDA; NVIDIA's "perf-torch-sync-free" guide lists
  `.item()`, `.cpu()`, boolean indexing and `torch.tensor` on CUDA as the usual culprits).
- Waits outside ATen: the lagging device's `LaggingEvent.synchronize` (what
  `transfer.wait_ready` calls), `Publisher.flush` while a copy it must fold is still in
  flight (the training thread waiting for the publisher thread, which waits for the device),
  and `Publisher.settle` if a copy it folds has not in truth completed (it folds only those
  that say they have: then it waits for Python work only).
`_assert_async` does not wait (the check runs on the device), so it is not counted.

Reads of hookprof's own host copies are no syncs: the tensors the device copy returns
(the host side of a one-value peek or a batch) and whatever is computed from them alone are
tracked, and a read of one is allowed once its copy's event says it has completed. A read
before that is recorded apart (`early_reads`): on CUDA it would read a copy still in flight.

Each would-sync is attributed by walking the Python stack (only for these rare ops): the
innermost frame outside torch, the standard library and this emulation decides. It is
hookprof's when that frame is in the `hookprof/` package, unless a `Profiler.flush` frame is
on the stack (a wait there is allowed: the caller asked for one); otherwise the user's.

What this cannot see (docs/development.md): host-to-device copies from pageable memory
(`torch.tensor(values, device="cuda")` waits; on the CPU there is no copy at all), streams
and events of the real CUDA API, and any code path that only runs when
`tensor.device.type == "cuda"`.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hookprof
from hookprof import _testing
from hookprof.publish import publisher
from support import lagging_device

HOOKPROF_DIR = os.path.dirname(os.path.abspath(hookprof.__file__)) + os.sep
_SKIPPED_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
)
_TORCH_DIR = _SKIPPED_DIRS[0]
_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(lagging_device.__file__)}
# hookprof's wrappers around the user's own torch calls: what torch does inside them (GradScaler
# reads found_inf with .item() for a non-fused optimizer) is the user's wait, with or without
# hookprof, so these frames are looked through
PASS_THROUGH = {("hookprof/step/gradscaler.py", "_maybe_opt_step")}

_TAGGED = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
# ops that return a Python value read from metadata only, never from the data
_METADATA = {
    "is_same_size",
    "is_set_to",
    "_nnz",
    "sparse_dim",
    "dense_dim",
    "is_coalesced",
    "_has_same_storage_numel",
    "_has_compatible_shallow_copy_type",
    "is_pinned",
    "_debug_has_internal_overlap",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "numel",
    "dim",
    "is_contiguous",
}
_BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}
_HOST_READS = {"tolist", "numpy", "__array__", "cpu"}
# torch.tensor(values) and friends without a device: host tensors on a GPU machine too
_HOST_FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "scalar_tensor"}


@dataclass(frozen=True)
class WouldSync:
    """One place that would make the host wait for the device on CUDA."""

    op: str  # "aten._local_scalar_dense.default", "Tensor.tolist", "LaggingEvent.synchronize"
    owner: str  # "hookprof", "flush" (hookprof, inside Profiler.flush: allowed) or "user"
    frame: str  # the innermost non-torch frame: "hookprof/nonfinite/replay.py:109 in poll"
    stack: tuple[str, ...]  # every non-torch frame, innermost first


def _file(frame) -> str:
    """hookprof/nonfinite/replay.py for hookprof's files, the bare name for others."""
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(HOOKPROF_DIR):
        return "hookprof/" + path[len(HOOKPROF_DIR) :]
    return os.path.basename(path)


def _where(frame) -> str:
    return f"{_file(frame)}:{frame.f_lineno} in {frame.f_code.co_name}"


def attribute(op: str) -> WouldSync:
    """Walk the caller's stack: whose code asked for `op`?"""
    frames, in_flush, in_torch = [], False, False
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(HOOKPROF_DIR) and frame.f_code.co_qualname == "Profiler.flush":
            in_flush = True
        if path in _SKIPPED_FILES or path.startswith(_SKIPPED_DIRS):
            if not frames:
                # the skipped frame just inside the first kept one: torch's code there means
                # the op came from a torch call (dispatch's plumbing, inside this watch's
                # own modes, never is that frame)
                in_torch = path.startswith(_TORCH_DIR)
        # torch's own code ran inside a pass-through wrapper: look through it; the wrapper's
        # own op (no torch frame inside it) is hookprof's
        elif frames or not in_torch or (_file(frame), frame.f_code.co_name) not in PASS_THROUGH:
            frames.append(frame)
        frame = frame.f_back
    if not frames:
        return WouldSync(op, "user", "?", ())
    stack = tuple(_where(f) for f in frames)
    hookprofs = os.path.abspath(frames[0].f_code.co_filename).startswith(HOOKPROF_DIR)
    owner = ("flush" if in_flush else "hookprof") if hookprofs else "user"
    return WouldSync(op, owner, stack[0], stack)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _argument(func, args, kwargs, name: str, default):
    """An argument by schema name, given positionally or by keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(
        func._schema.arguments
    ):  # an OpOverload's schema: torch's only record of it
        if arg.name == name:
            return args[i] if i < len(args) and not arg.kwarg_only else default
    return default


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ()
    )


class SyncWatch:
    """`with SyncWatch() as watch:` records every would-sync of this thread in `watch.found`.

    Enter it inside `lagging_device(...)` (it wraps the copy function that installs)."""

    def __init__(self) -> None:
        self.found: list[WouldSync] = []
        self.early_reads: list[WouldSync] = []
        self._host: dict[int, tuple[torch.Tensor, tuple]] = {}  # id -> (tensor kept alive, events)
        self._thread: threading.Thread | None = None
        self._modes = (_FunctionWatch(self), _DispatchWatch(self))
        self._restore: list = []

    # -- what was found -----------------------------------------------------------------
    def by(self, owner: str) -> list[WouldSync]:
        return [w for w in self.found if w.owner == owner]

    @property
    def hookprofs(self) -> list[WouldSync]:
        """hookprof's would-syncs outside Profiler.flush: there must be none."""
        return self.by("hookprof")

    # -- host copies ----------------------------------------------------------------------
    def events_of(self, tensors: list[torch.Tensor]) -> tuple | None:
        """The copy events behind `tensors` if every one is a host copy (or derived from
        host copies only); None when one of them is a device tensor."""
        events: tuple = ()
        for t in tensors:
            if t.device.type == "meta":
                continue  # shape-only tensors (FLOP counting): never on a device
            known = self._host.get(id(t))
            if known is None or known[0] is not t:
                return None
            events += known[1]
        return events

    def mark_host(self, outputs, events: tuple) -> None:
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = (t, events)

    def reads_device(self, tensors: list[torch.Tensor], op: str) -> bool:
        """Would reading `tensors` on the host wait for the device? Records an early read of
        a host copy still in flight."""
        events = self.events_of(tensors)
        if events is None:
            return True
        if not all(e is None or e.query() for e in events):  # the event itself, not hookprof's view
            self.early_reads.append(attribute(op))
        return False

    def record(self, op: str) -> None:
        self.found.append(attribute(op))

    def on_watched_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- installing -----------------------------------------------------------------------
    def __enter__(self) -> SyncWatch:
        self._thread = threading.current_thread()
        watch = self
        copy_owner, copy_name = _testing.device_copy_seam()
        start_copy = getattr(copy_owner, copy_name)
        synchronize = lagging_device.LaggingEvent.synchronize
        flush = publisher.Publisher.flush
        settle = publisher.Publisher.settle

        def copy_to_host(t):
            host, ready = start_copy(t)
            watch.mark_host(host, (ready,))
            return host, ready

        def waited(event):
            if watch.on_watched_thread():
                watch.record("LaggingEvent.synchronize")
            return synchronize(event)

        def flushed(pub, *args, **kwargs):
            # a wait for the device only while a copy it must fold is still in flight: a
            # flush of completed copies waits for the publisher's Python work alone
            if watch.on_watched_thread() and _testing.unfinished_copies(pub):
                watch.record("Publisher.flush")
            return flush(pub, *args, **kwargs)

        def settled(pub, *args, **kwargs):
            # settle folds only packets whose copies say they have completed: a wait for the
            # device only if one of those has not, in truth
            if watch.on_watched_thread() and _testing.settle_would_wait(pub):
                watch.record("Publisher.settle")
            return settle(pub, *args, **kwargs)

        setattr(copy_owner, copy_name, copy_to_host)
        lagging_device.LaggingEvent.synchronize = waited
        publisher.Publisher.flush = flushed
        publisher.Publisher.settle = settled
        self._restore = [
            (copy_owner, copy_name, start_copy),
            (lagging_device.LaggingEvent, "synchronize", synchronize),
            (publisher.Publisher, "flush", flush),
            (publisher.Publisher, "settle", settle),
        ]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for owner, name, value in self._restore:
            setattr(owner, name, value)
        self._host.clear()

    def report(self) -> str:
        return "\n".join(f"{w.owner}: {w.op} at {w.frame}" for w in self.found + self.early_reads)


def would_sync(func, args, kwargs, out) -> list[torch.Tensor] | None:
    """The tensors whose data the host must read for `func` on CUDA, or None: no wait."""
    packet = func.overloadpacket.__name__
    tensors = _tensors(args, kwargs)
    if not tensors:
        return None
    if packet in _BOOL_INDEXED:
        return tensors if _has_bool_index(args) else None
    if packet == "repeat_interleave" and func._overloadname == "Tensor":
        return tensors if _argument(func, args, kwargs, "output_size", None) is None else None
    if packet == "one_hot":
        return tensors if _argument(func, args, kwargs, "num_classes", -1) == -1 else None
    if packet in ("masked_fill", "masked_fill_") and func._overloadname == "Tensor":
        return [_argument(func, args, kwargs, "value", None)]
    if any(tag in func.tags for tag in _TAGGED):
        return tensors
    if isinstance(out, (bool, int, float, complex)) and packet not in _METADATA:
        return tensors
    return None


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, watch: SyncWatch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = would_sync(func, args, kwargs, out)
        if read is not None and self.watch.reads_device(read, str(func)):
            self.watch.record(str(func))
        inputs = _tensors(args, kwargs)
        events = self.watch.events_of(inputs) if inputs else None
        if events is not None:  # computed from host tensors alone: a host tensor too
            self.watch.mark_host(out, events)
        return out


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, watch: SyncWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS or (name == "to" and _to_host_blocking(args, kwargs)):
            self_ = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if self_ is not None and self.watch.reads_device([self_], f"Tensor.{name}"):
                self.watch.record(f"Tensor.{name}")
        out = func(*args, **kwargs)
        if name in _HOST_FACTORIES and kwargs.get("device") is None and func.__module__ == "torch":
            self.watch.mark_host(out, ())  # made on the host on a GPU machine too
        return out


def _to_host_blocking(args, kwargs) -> bool:
    """`t.to("cpu")` / `t.to(device="cpu")` without non_blocking: a blocking copy on CUDA.
    Only a target spelled "cpu" counts: in the emulation every device is the CPU, so
    `t.to(p.device)` (a same-device no-op on a GPU) cannot be told from a copy to the host."""
    if kwargs.get("non_blocking", False) or any(a is True for a in args[2:]):
        return False
    targets = list(args[1:2]) + [kwargs.get("device")]
    return any(isinstance(d, str) and torch.device(d).type == "cpu" for d in targets)
