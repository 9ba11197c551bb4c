"""services.commands.ports: a port handed out or reserved is never handed out again in this process."""

import socket

from services.commands.ports import free_port, free_port_run, reserve
from services.commands.redis_cluster import _cluster_port


def test_a_port_is_handed_out_once():
    seen = [free_port() for _ in range(300)]
    assert len(set(seen)) == len(seen)


def test_a_reserved_port_is_not_handed_out_and_cannot_be_reserved_twice():
    port = free_port()
    assert not reserve(port)
    base = free_port_run(3)
    assert not any(reserve(p) for p in range(base, base + 3))


def test_a_bound_port_cannot_be_reserved():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert not reserve(s.getsockname()[1])


def test_a_cluster_nodes_bus_port_is_never_given_to_another_child():
    # CI once gave an engine the port a cluster node bound as its bus port a moment later.
    bus = {_cluster_port() + 10000 for _ in range(6)}
    assert not bus & {free_port() for _ in range(2000)}
