"""How schedulers and routers reach the registry: one Redis (or Valkey) node, or a Redis/Valkey Cluster.

Cluster mode is chosen by the URL (`?cluster=true`, for managed services whose endpoint is a
configuration endpoint; the host part may list several nodes, `h1:p1,h2:p2`, so losing one does not strand
a client that starts later) or found by asking the node (`INFO cluster`). Every registry command touches one
key (services.registry.keys), so the same code runs on both; the cluster client follows MOVED and
failovers itself. Timeouts are short: a dead shard must cost a routing decision milliseconds, not seconds.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

TIMEOUT = 0.5
_TRUE = {"1", "true", "yes", "on"}


def redacted(redis_url: str) -> str:
    """The URL with any password replaced, for logs (the password comes from a Kubernetes Secret)."""
    parts = urlsplit(redis_url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return redis_url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def split_cluster_hint(redis_url: str) -> tuple[str, bool | None]:
    """The URL without its `cluster=` query parameter, and what that parameter said (None: absent)."""
    parts = urlsplit(redis_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    hint = [v for k, v in query if k == "cluster"]
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), (hint[-1].lower() in _TRUE) if hint else None


def startup_nodes(redis_url: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of a URL whose host part may list several nodes, comma-separated."""
    hosts = urlsplit(redis_url).netloc.rpartition("@")[2]
    out = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "6379")
        out.append((host, int(port or 6379)))
    return out


def is_cluster(redis_url: str) -> bool:
    """Whether the node at the URL runs in cluster mode (False when it cannot be asked)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return bool(client.info("cluster").get("cluster_enabled"))
        finally:
            client.close()
    except redis.RedisError:
        return False


def connect(redis_url: str, max_connections: int = 128, timeout: float = TIMEOUT) -> Redis | RedisCluster:
    """A client with short timeouts, for one node or a cluster.

    One node: a blocking pool, so a burst of requests waits (briefly) for a connection instead of failing
    with "too many connections", which would make a router treat a healthy Redis as down.
    A cluster: one retry only (a failing shard is reported at once; callers degrade and retry later), and
    slots of a shard that is failing over do not stop commands on the others.
    """
    url, hint = split_cluster_hint(redis_url)
    if hint if hint is not None else is_cluster(url):
        options = dict(max_connections=max_connections, socket_timeout=timeout, socket_connect_timeout=timeout,
                       require_full_coverage=False, retry=Retry(NoBackoff(), 1), reinitialize_steps=1)
        nodes = startup_nodes(url)
        if len(nodes) > 1:  # redis://:pw@h1:p1,h2:p2/0: any of them can introduce the client to the rest
            parts = urlsplit(url)
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], username=parts.username,
                                password=parts.password, ssl=parts.scheme == "rediss", **options)
        return RedisCluster.from_url(url, **options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout,
                                           socket_timeout=timeout, socket_connect_timeout=timeout,
                                           health_check_interval=5)
    return Redis.from_pool(pool)  # the client owns the pool: closing it closes the connections
