"""Free loopback TCP ports, for services that pick their own (`serve`'s internal replica, `up`'s
children) and for tests. A port found free can still be taken before it is bound; callers that
start a child retry or fail loudly."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free (`pagedserve up` puts its routers on consecutive ports)."""
    while True:
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
