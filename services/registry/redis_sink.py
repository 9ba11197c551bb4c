"""A scheduler's writes to the Redis registry: its record with a TTL, and its blocks in the inverted index.

Each stored block is one ZADD on that block's key, each eviction one ZREM, sent in one pipeline per
publish (a cluster client splits it per shard). A full resync takes a new generation: the new entries are
written first, then the record that names them, so readers switch atomically; the old generation's
entries are removed afterwards, best effort (readers ignore them anyway).

Every method raises on a Redis failure; the publisher loop decides what an outage means (retry, then
resync everything once Redis is back), so nothing here hides an error.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import asdict

from redis.asyncio import Redis

from services.registry import keys
from services.registry.change_entry import entry_fields
from services.registry.model import BlockDelta, ReplicaLoad, ReplicaState, Signer
from services.registry.redis_connect import connect, redacted  # noqa: F401  (the registry's client)

_CHUNK = 4000  # commands per pipeline round trip: keeps single writes small
# A bundle outlives any one heartbeat by far (it is megabytes: written once, then only its TTL renewed).
TOKENIZER_TTL_MS = 3_600_000


def new_generation() -> int:
    """48 random bits: unique across the fleet without a shared counter (which a failover could lose)."""
    return secrets.randbits(48) or 1


class RedisSink:
    def __init__(self, client: Redis, namespace: str = keys.DEFAULT_NAMESPACE, signer: Signer | None = None):
        self.client = client
        self.ns = namespace
        self.signer = signer  # the internal token: records are signed so routers can trust them
        self._generation: dict[str, int] = {}  # replica id -> generation its record names
        self._filed: dict[str, set[int]] = {}  # replica id -> blocks filed under that generation
        self._stale: tuple[int, set[int]] | None = None  # a replaced generation, dropped once unnamed
        self._bundles: dict[str, bytes] = {}  # tokenizer digest -> bundle, re-written if Redis lost it
        self._written: dict[str, dict] = {}  # replica id -> the info of its last record written (as a dict)

    def generation_of(self, replica_id: str) -> int | None:
        """The generation the replica's blocks are filed under now (None: nothing filed yet)."""
        return self._generation.get(replica_id)

    async def write_tokenizer(self, digest: str, bundle: bytes) -> None:
        """Publish a tokenizer bundle under its digest (write_state keeps it alive while records name it)."""
        self._bundles[digest] = bundle
        await self.client.set(keys.tokenizer_key(self.ns, digest), bundle, px=TOKENIZER_TTL_MS)

    async def write_state(self, state: ReplicaState, ttl: float) -> None:
        rid = state.info.replica_id
        info = dataclasses.replace(state.info, generation=self._generation.get(rid, 0))
        digest = info.tokenizer_digest if info.tokenizer_digest in self._bundles else ""
        pipe = self.client.pipeline(transaction=False)
        if digest:  # before the record that names it: a router reading the record finds the bundle
            pipe.pexpire(keys.tokenizer_key(self.ns, digest), TOKENIZER_TTL_MS)
        pipe.set(keys.replica_key(self.ns, rid), ReplicaState(info, state.load).to_json(self.signer),
                 px=int(ttl * 1000))
        pipe.sadd(keys.replicas_key(self.ns), rid)
        written = asdict(info)  # a copy: a publisher may change its info's adapters in place
        same_info = self._written.get(rid) == written
        results = await pipe.execute()
        self._written[rid] = written
        # After the record is written (on a cluster the stream may live on another shard): a router that
        # sees the change reads the new record, or, when only the load moved, takes the load from the entry.
        await self._changed(rid, (info.generation, state.load) if same_info else None)
        if digest and not results[0]:  # Redis restarted empty since it was written
            await self.write_tokenizer(digest, self._bundles[digest])
        stale, self._stale = self._stale, None
        if stale:  # the record now names the new generation: the old one's entries can go
            await self._file(stale[0], (), stale[1])

    async def write_blocks(self, replica_id: str, delta: BlockDelta, ttl: float) -> None:
        gen = self._generation.get(replica_id)
        if gen is None:  # nothing filed yet: the first write is a full one
            await self.replace_blocks(replica_id, set(delta.stored), ttl)
            return
        filed = self._filed[replica_id]
        await self._file(gen, delta.stored, delta.removed)
        filed |= delta.stored
        filed -= delta.removed

    async def replace_blocks(self, replica_id: str, blocks: set[int], ttl: float) -> None:
        old_gen, old = self._generation.get(replica_id), self._filed.get(replica_id, set())
        gen = new_generation()
        await self._file(gen, blocks, ())
        self._generation[replica_id], self._filed[replica_id] = gen, set(blocks)
        # Routers keep matching the old generation until the record names the new one (the publisher
        # writes it right after a resync); write_state then drops the old entries.
        if old_gen is not None:
            self._stale = (old_gen, old)

    async def remove_replica(self, replica_id: str) -> None:
        self._written.pop(replica_id, None)
        pipe = self.client.pipeline(transaction=False)
        pipe.srem(keys.replicas_key(self.ns), replica_id)
        pipe.delete(keys.replica_key(self.ns, replica_id))
        await pipe.execute()
        await self._changed(replica_id)
        gen = self._generation.pop(replica_id, None)
        if gen is not None:
            await self._file(gen, (), self._filed.pop(replica_id, set()))

    async def _changed(self, replica_id: str, load: tuple[int, ReplicaLoad] | None = None) -> None:
        """Note a write or removal of the record in the change stream; `load`: (generation, load) when the
        record's info is the one this sink wrote last time, so the entry alone tells routers what changed
        (services.registry.change_entry)."""
        await self.client.xadd(keys.changes_key(self.ns), entry_fields(replica_id, load, self.signer),
                               maxlen=keys.CHANGES_MAXLEN, approximate=True)

    async def _file(self, gen: int, stored, removed) -> None:
        commands = block_commands(self.ns, gen, stored, removed)
        for i in range(0, len(commands), _CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for args in commands[i:i + _CHUNK]:
                pipe.execute_command(*args)
            await pipe.execute()


def block_commands(ns: str, gen: int, stored, removed) -> list[tuple[str, ...]]:
    """The index writes for blocks stored and removed under a generation: one single-key command each."""
    member = str(gen)
    return ([("ZADD", keys.block_key(ns, h), keys.STORED, member) for h in stored]
            + [("ZREM", keys.block_key(ns, h), member) for h in removed])
