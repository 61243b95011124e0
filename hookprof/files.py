"""Every file hookprof writes is written here: whole or not at all, and never through a link.

A report or a NaN dump is written beside its target under a temporary name nobody can
predict (pid and 64 random bits), opened with O_CREAT|O_EXCL|O_NOFOLLOW so that a file or a
symlink planted there is never opened, let alone written through; flushed to the disk
(fsync) and renamed over the target in one step (os.replace). A reader sees the previous
file or the new one, never a part of one. Any failure (a full disk, a directory that cannot
be made, a write interrupted) removes the temporary file and raises the OSError: the
previous file at `path` is left as it was.

Permissions are a plain `open(path, "w")`'s: 0o666 less the process's umask (reports are
meant to be read by whoever reads the run's directory; a umask of 077 keeps them private).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets

_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_TRIES = 8  # names taken (64 random bits: only by an attacker who reads our memory)


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, make_dirs: bool = False
) -> str:
    """Write `data` (str as UTF-8) to `path` atomically; returns the path as a str.

    `make_dirs`: create the missing directories above `path` first (mode 0o777 less umask).
    Raises OSError (the file at `path` unchanged, no temporary file left)."""
    path = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    directory, name = os.path.split(os.path.abspath(path))
    if make_dirs:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = _open_temporary(directory, name)
    try:
        try:
            view = memoryview(payload)
            while view:  # os.write may write less than asked (a signal, a pipe-like target)
                view = view[os.write(fd, view) :]
            os.fsync(fd)  # the bytes on the disk before the name points at them
        finally:
            os.close(fd)
        os.replace(tmp, path)  # renames over a symlink at `path`, never through it
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone (replaced) or never made: nothing of ours is left
        raise
    _sync_directory(directory)
    return path


def _open_temporary(directory: str, name: str) -> tuple[int, str]:
    """A new file in `directory` (the same file system as the target, so os.replace is one
    rename), under a name with this process's id and random bits: writers in other processes
    and other threads never share one."""
    for attempt in range(_TRIES):
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, _FLAGS, 0o666), tmp
        except FileExistsError:
            if attempt == _TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _sync_directory(directory: str) -> None:
    """The rename itself on the disk (best effort: not every platform opens directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_label(name: str) -> str:
    """`name` (a model's label) as a plain file-name part: characters other than letters,
    digits, `_`, `.`, `-` made `_`, with a short hash of the real name when any was, so
    that two names never become one."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "model"
    if safe != name:
        safe += "-" + hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return safe
