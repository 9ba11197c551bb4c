"""How schedulers and routers reach the registry: one Redis (or Valkey) node, or a Redis/Valkey Cluster.

Cluster mode is chosen by the URL (`?cluster=true`, for managed services whose endpoint is a
configuration endpoint) or found by asking the node (`INFO cluster`). Every registry command touches one
key (services.registry.keys), so the same code runs on both; the cluster client follows MOVED and
failovers itself. Timeouts are short: a dead shard must cost a routing decision milliseconds, not seconds.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

TIMEOUT = 0.5
_TRUE = {"1", "true", "yes", "on"}


def redacted(redis_url: str) -> str:
    """The URL with any password replaced, for logs (the password comes from a Kubernetes Secret)."""
    parts = urlsplit(redis_url)
    if parts.password is None:
        return redis_url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def split_cluster_hint(redis_url: str) -> tuple[str, bool | None]:
    """The URL without its `cluster=` query parameter, and what that parameter said (None: absent)."""
    parts = urlsplit(redis_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    hint = [v for k, v in query if k == "cluster"]
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), (hint[-1].lower() in _TRUE) if hint else None


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
        return RedisCluster.from_url(url, max_connections=max_connections, socket_timeout=timeout,
                                     socket_connect_timeout=timeout, require_full_coverage=False,
                                     retry=Retry(NoBackoff(), 1), reinitialize_steps=1)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout,
                                           socket_timeout=timeout, socket_connect_timeout=timeout,
                                           health_check_interval=5)
    return Redis.from_pool(pool)  # the client owns the pool: closing it closes the connections
