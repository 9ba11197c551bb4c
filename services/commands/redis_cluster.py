"""A real local Redis (or Valkey) Cluster for `pagedserve up --redis-cluster N`, the index benchmark and tests.

N primaries and N replicas (`redis-server --cluster-enabled yes`), joined the way `redis-cli --cluster
create --cluster-replicas 1` does it, but with the cluster commands themselves (CLUSTER MEET, ADDSLOTS,
REPLICATE), so only the server binary is needed. A short node timeout lets a replica take over within
seconds when its primary dies (kill_primary), which is what failover tests and benchmarks exercise.
"""

from __future__ import annotations

import secrets
import signal
import socket
import tempfile
import time
from pathlib import Path

import redis

from services.commands.ports import free_port, reserve
from services.commands.processes import Child
from services.commands.redis_binary import find_redis_server, missing_message

SLOTS = 16384
NODE_TIMEOUT_MS = 1000


class LocalRedisCluster:
    def __init__(self, shards: int = 3, password: str | None = None, node_timeout_ms: int = NODE_TIMEOUT_MS):
        if shards < 1:
            raise ValueError("a Redis cluster needs at least one shard")
        self.shards = shards
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self.node_timeout_ms = node_timeout_ms
        self.ports = [_cluster_port() for _ in range(2 * shards)]  # primaries first, then their replicas
        self.nodes: list[Child] = []
        self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-cluster-")

    @property
    def url(self) -> str:
        """Every node, marked as a cluster (a client starting after a node died still gets in)."""
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis://:{self.password}@{nodes}/0?cluster=true"

    def start(self, timeout: float = 60.0) -> LocalRedisCluster:
        exe = find_redis_server()
        if exe is None:
            raise RuntimeError(missing_message())
        for port in self.ports:
            conf = (f"port {port}\nbind 127.0.0.1\ncluster-enabled yes\n"
                    f"cluster-config-file {Path(self._dir.name) / f'nodes-{port}.conf'}\n"
                    f"cluster-node-timeout {self.node_timeout_ms}\nsave \"\"\nappendonly no\n"
                    # validity factor 0: a replica may always take over (these are fresh local nodes)
                    f"dir {self._dir.name}\nloglevel warning\ncluster-replica-validity-factor 0\n"
                    f"requirepass {self.password}\nmasterauth {self.password}\n")
            # The config (with the password) goes in through stdin, not argv, which /proc shows.
            node = Child(f"redis-{port}", [exe, "-"], quiet=True, stdin=conf)
            node.start()
            self.nodes.append(node)
        deadline = time.monotonic() + timeout
        for port in self.ports:
            _wait_port(port, deadline)
        self._join(deadline)
        return self

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=5, decode_responses=True)

    def _join(self, deadline: float) -> None:
        clients = [self._client(p) for p in self.ports]
        try:
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            per = SLOTS // self.shards
            for i in range(self.shards):
                hi = SLOTS if i == self.shards - 1 else (i + 1) * per
                clients[i].execute_command("CLUSTER", "ADDSLOTS", *range(i * per, hi))
            ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
            _until(lambda: all(len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(clients)
                               for c in clients), deadline, "cluster nodes did not meet")
            for i in range(self.shards):  # replica of primary i
                _until(lambda i=i: _replicate(clients[self.shards + i], ids[i]), deadline,
                       "replica did not attach")
            self.wait_ok(deadline - time.monotonic())
        finally:
            for c in clients:
                c.close()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and every slot is served by a live primary."""
        deadline = time.monotonic() + timeout

        def ok() -> bool:
            live = {p for p, n in zip(self.ports, self.nodes, strict=True) if n.alive}
            for port, node in zip(self.ports, self.nodes, strict=True):
                if not node.alive:
                    continue
                c = self._client(port)
                try:
                    info = dict(line.split(":", 1) for line in
                                c.execute_command("CLUSTER", "INFO").splitlines() if ":" in line)
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != SLOTS:
                        return False
                    if any(int(primary[1]) not in live for _, _, primary, *_ in c.execute_command("CLUSTER", "SLOTS")):
                        return False  # a dead primary not yet replaced
                finally:
                    c.close()
            return True

        _until(ok, deadline, "cluster did not reach state ok")

    def kill_primary(self, shard: int) -> None:
        """SIGKILL the node currently serving a shard's slots as primary: its replica takes over."""
        port = self.primary_port(shard)
        node = self.nodes[self.ports.index(port)]
        node.signal(signal.SIGKILL)
        node.wait(10)

    def primary_port(self, shard: int) -> int:
        """The port of the live primary that serves the slots shard `shard` started with."""
        slot = shard * (SLOTS // self.shards)
        for port, node in zip(self.ports, self.nodes, strict=True):
            if not node.alive:
                continue
            c = self._client(port)
            try:
                for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if int(lo) <= slot <= int(hi):
                        return int(primary[1])
            finally:
                c.close()
        raise RuntimeError("no live node answers CLUSTER SLOTS")

    def stop(self) -> None:
        for node in self.nodes:
            node.signal(signal.SIGTERM)
        for node in self.nodes:
            node.wait(10)
        self._dir.cleanup()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, so at most 55535. Both are reserved,
    so nothing else this process starts is given the bus port before the node binds it."""
    for _ in range(1000):
        port = free_port()
        if port <= 55535 and reserve(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _replicate(client: redis.Redis, primary_id: str) -> bool:
    try:
        client.execute_command("CLUSTER", "REPLICATE", primary_id)
        return True
    except redis.ResponseError:  # the primary is not known to this node yet
        return False


def _until(check, deadline: float, what: str) -> None:
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _wait_port(port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)
