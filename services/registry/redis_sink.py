"""A scheduler's writes to the Redis registry: its record with a TTL, and its cached-block set.

Every method raises on a Redis failure; the publisher loop decides what an outage means (retry, then
resync everything once Redis is back), so nothing here hides an error.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

from services.registry import keys
from services.registry.model import BlockDelta, ReplicaState, Signer

_CHUNK = 2000  # hashes per SADD/SREM: keeps single commands small


def redacted(redis_url: str) -> str:
    """The URL with any password replaced, for logs (the password comes from a Kubernetes Secret)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(redis_url)
    if parts.password is None:
        return redis_url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(redis_url: str, max_connections: int = 128) -> Redis:
    """A client with short timeouts: a dead Redis must cost a routing decision milliseconds, not seconds.

    A blocking pool: a burst of requests waits (briefly) for a connection instead of failing with "too
    many connections", which would make a router treat a healthy Redis as down.
    """
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=max_connections, timeout=0.5,
                                           socket_timeout=0.5, socket_connect_timeout=0.5, health_check_interval=5)
    return Redis.from_pool(pool)  # the client owns the pool: closing it closes the connections


def _chunks(values: list[str]):
    for i in range(0, len(values), _CHUNK):
        yield values[i:i + _CHUNK]


class RedisSink:
    def __init__(self, client: Redis, namespace: str = keys.DEFAULT_NAMESPACE, signer: Signer | None = None):
        self.client = client
        self.ns = namespace
        self.signer = signer  # the internal token: records are signed so routers can trust them

    async def write_state(self, state: ReplicaState, ttl: float) -> None:
        rid = state.info.replica_id
        pipe = self.client.pipeline(transaction=False)
        pipe.set(keys.replica_key(self.ns, rid), state.to_json(self.signer), px=int(ttl * 1000))
        pipe.sadd(keys.replicas_key(self.ns), rid)
        # The block set outlives a dead replica only as long as its record would have.
        pipe.pexpire(keys.blocks_key(self.ns, rid), int(ttl * 1000) * 10)
        await pipe.execute()

    async def write_blocks(self, replica_id: str, delta: BlockDelta, ttl: float) -> None:
        key = keys.blocks_key(self.ns, replica_id)
        pipe = self.client.pipeline(transaction=True)
        for part in _chunks([str(h) for h in delta.stored]):
            pipe.sadd(key, *part)
        for part in _chunks([str(h) for h in delta.removed]):
            pipe.srem(key, *part)
        pipe.pexpire(key, int(ttl * 1000) * 10)
        await pipe.execute()

    async def replace_blocks(self, replica_id: str, blocks: set[int], ttl: float) -> None:
        key = keys.blocks_key(self.ns, replica_id)
        pipe = self.client.pipeline(transaction=True)  # readers never see a half-written set
        pipe.delete(key, keys.pending_key(self.ns, replica_id))
        for part in _chunks([str(h) for h in blocks]):
            pipe.sadd(key, *part)
        pipe.pexpire(key, int(ttl * 1000) * 10)
        await pipe.execute()

    async def remove_replica(self, replica_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(keys.replicas_key(self.ns), replica_id)
        pipe.delete(keys.replica_key(self.ns, replica_id), keys.blocks_key(self.ns, replica_id),
                    keys.pending_key(self.ns, replica_id))
        await pipe.execute()
