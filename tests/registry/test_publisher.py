"""Registry + prefix index against a real redis-server, a real local Redis Cluster, and the in-memory twin
used by `serve`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.contracts.block_hash import hash_blocks, model_hash_seed
from services.registry.index_grid import STRIDE, filed_positions
from services.registry.memory_index import MemoryIndex
from services.registry.model import ReplicaInfo, ReplicaLoad
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, connect
from services.router.redis_index import RedisIndex

SEED = model_hash_seed("m", 4)


@dataclass
class KVEvent:
    kind: str
    block_hashes: list[int]
    positions: list[int]


def event(kind: str, hashes: list[int], start: int = 0) -> KVEvent:
    """A scheduler's event for the chain positions start, start + 1, ..."""
    return KVEvent(kind, hashes, list(range(start, start + len(hashes))))


@dataclass
class FakeReplica:
    """The publisher's view of a scheduler: load figures and a queue of KV events."""

    load_now: ReplicaLoad = field(default_factory=ReplicaLoad)
    events: list = field(default_factory=list)

    def load(self) -> ReplicaLoad:
        return self.load_now

    def drain_kv_events(self) -> list:
        out, self.events = self.events, []
        return out


def _info(rid: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id=rid, url=f"http://{rid}", model="m", block_size=4, max_model_len=128,
                       capacity=8, hash_seed=SEED)


def _backends(redis_url: str | None):
    if redis_url is None:
        index = MemoryIndex()
        return index, index
    client = connect(redis_url)
    return RedisSink(client), RedisIndex(client, record_refresh=0)  # the registry's latest word, at once


@pytest.fixture(params=["redis", "cluster", "memory"])
def backend(request):
    if request.param == "memory":
        return _backends(None)
    return _backends(request.getfixturevalue("redis_cluster" if request.param == "cluster" else "redis_server").url)


def test_snapshot_counts_leading_cached_blocks_per_replica(backend):
    sink, index = backend
    prompt = list(range(96))  # 24 blocks of 4: filed are positions 0-7, 15 and 23 (index_grid)
    hashes = hash_blocks(prompt, 4, SEED)

    async def scenario():
        a, b = FakeReplica(), FakeReplica(ReplicaLoad(num_waiting=2, num_running=3, kv_usage=0.5))
        pub_a, pub_b = ReplicaPublisher(sink, _info("a"), a), ReplicaPublisher(sink, _info("b"), b)
        a.events.append(event("stored", hashes[:6]))
        b.events.append(event("stored", hashes[:20]))
        await pub_a.tick()
        await pub_b.tick()
        states = {s.info.replica_id: s for s in await index.snapshot(hashes)}
        # Exact within the dense head; beyond it, to the deepest filed position held (b holds 20: 16).
        assert states["a"].matched_blocks == 6 and states["b"].matched_blocks == 16
        assert states["b"].load.requests == 5 and states["b"].info.url == "http://b"
        assert states["b"].load.cached_blocks == 20  # every block it holds, filed or not

        a.events.append(event("removed", hashes[4:6], 4))  # engines evict a chain's tail first
        await pub_a.tick()
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)}["a"] == 4

        await index.claim("b", hashes, 16)  # a router just sent this prompt to b
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)}["b"] == 24
        assert {s.matched_blocks for s in await index.snapshot([])} == {0}

        pub_b.reset_blocks()  # b's engine restarted: its cache and the claims on it are gone
        await pub_b.tick()
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)}["b"] == 0

        await pub_a.close()
        assert [s.info.replica_id for s in await index.snapshot(hashes)] == ["b"]

    asyncio.run(scenario())


def test_blocks_off_the_grid_are_never_written(backend):
    """Of a long chain only the filed positions reach the index: one write in STRIDE beyond the head."""
    sink, index = backend
    hashes = hash_blocks(list(range(4 * 200)), 4, SEED)

    async def scenario():
        a = FakeReplica()
        pub = ReplicaPublisher(sink, _info("a"), a)
        a.events.append(event("stored", hashes[104:200], 104))  # a long sequence's later blocks
        await pub.tick()
        assert pub._mirror == {hashes[p] for p in filed_positions(104, 200)}
        assert len(pub._mirror) == 96 // STRIDE
        a.events.append(event("stored", hashes[:104]))
        await pub.tick()
        assert {s.matched_blocks for s in await index.snapshot(hashes)} == {200}
        assert {s.matched_blocks for s in await index.snapshot(hashes[:198])} == {192}
        await pub.close()

    asyncio.run(scenario())


def test_records_expire_without_heartbeat(backend):
    sink, index = backend

    async def scenario():
        pub = ReplicaPublisher(sink, _info("a"), FakeReplica(), heartbeat_interval=0.1)
        pub.ttl = 0.3
        await pub.tick()
        assert len(await index.snapshot([])) == 1
        await asyncio.sleep(0.5)
        assert await index.snapshot([]) == []

    asyncio.run(scenario())


def test_publisher_survives_redis_outage_and_resyncs_blocks(private_redis):
    sink, index = _backends(private_redis.url)
    hashes = hash_blocks(list(range(32)), 4, SEED)
    replica = FakeReplica()

    async def scenario():
        pub = ReplicaPublisher(sink, _info("a"), replica, heartbeat_interval=0.1, event_interval=0.02)
        task = asyncio.create_task(pub.run())
        replica.events.append(event("stored", hashes[:3]))
        await asyncio.sleep(0.2)
        private_redis.stop()  # Redis dies, and comes back empty
        replica.events.append(event("stored", hashes[3:6], 3))
        await asyncio.sleep(0.3)
        private_redis.start()
        for _ in range(100):
            await asyncio.sleep(0.05)
            try:
                states = await index.snapshot(hashes)
            except Exception:
                continue
            if states and states[0].matched_blocks == 6:
                break
        assert [s.matched_blocks for s in states] == [6]
        await pub.close()
        task.cancel()

    asyncio.run(scenario())


def test_the_tokenizer_bundle_is_published_and_outlives_a_redis_restart(backend, smol_tokenizer):
    """The replica publishes its tokenizer bundle under its digest (the router's only source of it); a
    Redis that lost it gets it again on the next heartbeat."""
    sink, index = backend
    info = _info("a")
    info.tokenizer_digest = smol_tokenizer.digest

    async def go():
        pub = ReplicaPublisher(sink, info, FakeReplica(), heartbeat_interval=0.05,
                               tokenizer_bundle=smol_tokenizer.bundle)
        await pub.tick()
        assert await index.tokenizer(smol_tokenizer.digest) == smol_tokenizer.bundle
        states = await index.snapshot([])
        assert states[0].info.tokenizer_digest == smol_tokenizer.digest
        if isinstance(sink, RedisSink):
            await sink.client.flushall()
            await asyncio.sleep(0.06)
            await pub.tick()  # the heartbeat notices the bundle is gone and writes it again
            assert await index.tokenizer(smol_tokenizer.digest) == smol_tokenizer.bundle
        await pub.close()
        await index.close()

    asyncio.run(go())
