"""One style of undo for everything hookprof puts in place (issue 40): an install returns a
handle whose `remove()` takes out exactly what that install put in, once (a second call does
nothing, as torch's `RemovableHandle`), and which is a context manager. Several handles go
in a `HandleGroup`, removed last in, first out; `Profiler`'s teardown is an `ExitStack` of
handles. Nothing is undone by position in a list.

A foundation: imports nothing of hookprof's."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # (typing.Self from Python 3.11)
    from typing_extensions import Self


class Removable(Protocol):
    """Anything with an idempotent `remove()`: a Handle, a HandleGroup, torch's RemovableHandle."""

    def remove(self) -> None: ...


class _RemovedOnExit:
    """`with handle:` removes it at the block's end."""

    __slots__ = ()

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()


class Handle(_RemovedOnExit):
    """Undoes one install: `remove()` calls `undo` the first time, never again."""

    __slots__ = ("_undo",)

    def __init__(self, undo: Callable[[], Any]) -> None:
        self._undo: Callable[[], Any] | None = undo

    @property
    def removed(self) -> bool:
        return self._undo is None

    def remove(self) -> None:
        undo, self._undo = self._undo, None  # first: an undo that raises is not run twice
        if undo is not None:
            undo()


class HandleGroup(_RemovedOnExit):
    """Handles removed together, the last added first; `remove()` empties the group (a group
    can take new handles after it, and removing it again does nothing). Every member is
    removed even when one raises: the first error is raised once all have been tried."""

    __slots__ = ("members",)

    def __init__(self) -> None:
        # read, not written, from outside: `if group.members` asks "anything in place?" with
        # no Python call (len() of the group is one; it is asked in hooks on every step)
        self.members: list[Removable] = []

    def add(self, handle: Removable) -> Removable:
        self.members.append(handle)
        return handle

    def __len__(self) -> int:
        return len(self.members)

    def remove(self) -> None:
        first: BaseException | None = None
        while self.members:
            try:
                self.members.pop().remove()
            except BaseException as exc:  # the others still go
                first = first or exc
        if first is not None:
            raise first
