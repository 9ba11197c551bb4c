"""Free loopback TCP ports, for services that pick their own (`serve`'s internal replica, `up`'s
children) and for tests. A port found free can still be taken before it is bound; callers that
start a child retry or fail loudly.

Ports are picked long before they are bound (`up` plans every child, then starts them), so a port this
process has handed out, or reserved for a child that will bind it (a Redis Cluster node's bus port,
port + 10000), is never handed out again: otherwise an engine could be given a bus port that a cluster
node binds a moment later."""

from __future__ import annotations

import socket
import threading

_taken: set[int] = set()
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def reserve(port: int) -> bool:
    """Claim `port` for a child of this process; False if it is taken here or bound elsewhere."""
    with _lock:
        if port in _taken or not _bindable(port):
            return False
        _taken.add(port)
        return True


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _lock:
            if port not in _taken:
                _taken.add(port)
                return port


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free (`pagedserve up` puts its routers on consecutive ports)."""
    while True:
        base = free_port()
        if all(reserve(p) for p in range(base + 1, base + n)):
            return base
