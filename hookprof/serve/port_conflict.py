"""A metrics port another process holds: who holds it, what is said, what is exported.

`Config.port_conflict` decides what follows (serve/endpoint.py): "free" serves on a port the
system picks, "off" serves nothing, "raise" raises PortInUseError as attach always did. The
first two keep training: a tool meant to stay on for the whole run must not lose the run
over its metrics port.

The holder is looked up the way `ss -ltnp` does: the listening socket's inode in
/proc/net/tcp{,6}, then the process whose /proc/<pid>/fd has `socket:[inode]`. Only the
processes of this user can be read; on other systems, or for another user's process, the
holder is unknown and the message says what finds it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hookprof.metrics_names import METRICS_PORT_CONFLICT_INFO, family

log = logging.getLogger("hookprof")

_LISTEN = "0A"  # the TCP state column of /proc/net/tcp
_MAX_COMMAND = 80  # characters of the holder's command line kept (a label value, a log line)


def _listening_inodes(port: int, proc: str) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", table), encoding="ascii") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    # local_address is HEXADDR:HEXPORT; inode is the tenth column
                    if (
                        len(fields) > 9
                        and fields[3] == _LISTEN
                        and int(fields[1].rsplit(":", 1)[1], 16) == port
                    ):
                        inodes.add(fields[9])
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def _command(proc: str, pid: str) -> str:
    try:
        with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(" ".join(w.decode(errors="replace").split()) for w in words if w)  # one line
    return text if len(text) <= _MAX_COMMAND else text[: _MAX_COMMAND - 3] + "..."


def port_holder(port: int, proc: str = "/proc") -> str | None:
    """ "pid 1234 (python -m http.server 8479)" for the process listening on TCP `port`, or
    None when it cannot be found. Never raises."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port, proc)}
    if not wanted:
        return None
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    return f"pid {pid} ({_command(proc, pid)})"
            except OSError:
                continue
    return None


@dataclass(frozen=True, slots=True)
class PortConflict:
    """The port hookprof was asked to serve, found taken, and by whom (None: not found)."""

    addr: str
    port: int
    holder: str | None

    def say(self, served_port: int | None) -> None:
        """The one log error: the port, its holder, and where metrics are served instead."""
        held = (
            f"held by {self.holder}"
            if self.holder
            else f"held by another process (`ss -ltnp` or `lsof -i :{self.port}` names it)"
        )
        if served_port is None:
            instead = 'metrics are not served (port_conflict="off")'
        else:
            instead = f'serving metrics on {self.addr}:{served_port} instead (port_conflict="free")'
        log.error(
            "hookprof: cannot serve metrics on %s:%d, %s; %s. Training goes on. Choose a free "
            'port with port=... or HOOKPROF_PORT; port_conflict="raise" stops at attach instead.',
            self.addr,
            self.port,
            held,
            instead,
        )


class PortConflictInfo(Collector):
    """hookprof_metrics_port_conflict_info{wanted_port, holder} = 1 on the page of an
    endpoint that serves on a free port because the configured one was taken."""

    def __init__(self, conflict: PortConflict):
        self._conflict = conflict

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = family(METRICS_PORT_CONFLICT_INFO)
        # the pid only: a command line can hold a token or a password, and the page is
        # read by anyone who reaches the port (the log line has the command)
        holder = self._conflict.holder
        info.add_metric(
            [str(self._conflict.port), holder.split(" (", 1)[0] if holder else "unknown"], 1
        )
        yield info
