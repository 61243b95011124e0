"""Free TCP ports on loopback, for servers a test starts on a port it chooses."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, avoid: tuple[int, ...] = ()) -> int:
    """A port p with p .. p+n-1 all free right now (per-rank ports are base + LOCAL_RANK)."""
    for _ in range(100):
        base = free_port()
        ports = range(base, base + n)
        if not set(ports) & set(avoid) and all(port_is_free(p) for p in ports[1:]):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def port_is_free(port: int, addr: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
        return True
