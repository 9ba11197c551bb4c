"""The router's prefix index on a real redis-server: what one decision costs in Redis commands does not
depend on the number of replicas, and dead replicas' entries cost nothing."""

from __future__ import annotations

import asyncio

import redis

from services.registry.model import BlockDelta, ReplicaInfo, ReplicaLoad, ReplicaState
from services.registry.redis_sink import RedisSink, connect
from services.router.redis_index import RedisIndex


def commands(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_") and k != "cmdstat_info")


async def fleet(url: str, n: int, prompt: list[int]) -> tuple[dict[str, int], int]:
    """n replicas hold the prompt's first 4 blocks, replica-0 its first 40; one decision's matches and
    the Redis commands it took."""
    client = connect(url)
    sink = RedisSink(client)
    for i in range(n):
        rid = f"replica-{i}"
        await sink.write_blocks(rid, BlockDelta(stored=set(prompt[:40] if i == 0 else prompt[:4])), ttl=60)
        await sink.write_state(ReplicaState(ReplicaInfo(rid, "http://x", "m", 16, 4096, 8, 1), ReplicaLoad()), 60)
    index = RedisIndex(client)
    await index.snapshot([])  # records are read in the background, not per decision
    before = commands(url)
    states = await index.snapshot(prompt)
    used = commands(url) - before
    await index.close()
    await client.aclose()
    return {s.info.replica_id: s.matched_blocks for s in states}, used


def test_a_decision_costs_the_same_commands_for_3_or_300_replicas(redis_server):
    prompt = list(range(1000, 1064))  # 64 block hashes
    small, small_cost = asyncio.run(fleet(redis_server.url, 3, prompt))
    redis_server.flush()
    big, big_cost = asyncio.run(fleet(redis_server.url, 100, prompt))
    assert small == {"replica-0": 40, "replica-1": 4, "replica-2": 4}
    assert big["replica-0"] == 40 and len(big) == 100
    # O(log prompt blocks), whatever the fleet: 100 holders of the header cost no more than 3 (the search
    # stops at a depth with more holders than it reads).
    assert big_cost <= small_cost <= 30


def test_dead_and_superseded_generations_are_ignored(redis_server):
    async def scenario():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        hashes = list(range(1, 33))
        info = ReplicaInfo("a", "http://a", "m", 16, 4096, 8, 1)
        await sink.write_blocks("a", BlockDelta(stored=set(hashes)), ttl=60)
        await sink.write_state(ReplicaState(info, ReplicaLoad()), ttl=0.3)
        await sink.write_blocks("b", BlockDelta(stored=set(hashes[:8])), ttl=60)
        await sink.write_state(ReplicaState(ReplicaInfo("b", "http://b", "m", 16, 4096, 8, 1), ReplicaLoad()), 60)
        index = RedisIndex(client, record_refresh=0)
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)} == {"a": 32, "b": 8}
        await asyncio.sleep(0.5)  # a died: its record expired, its entries are still there
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)} == {"b": 8}
        await sink.replace_blocks("b", set(hashes[:2]), ttl=60)  # b resynced: a new generation
        await sink.write_state(ReplicaState(ReplicaInfo("b", "http://b", "m", 16, 4096, 8, 1), ReplicaLoad()), 60)
        assert {s.info.replica_id: s.matched_blocks for s in await index.snapshot(hashes)} == {"b": 2}
        await client.aclose()

    asyncio.run(scenario())


def test_a_shared_header_too_short_to_act_on_is_never_read(redis_server):
    """Every replica holds the 4-block header: below the policy's useful depth its 100 holders are skipped."""
    async def scenario():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        prompt = list(range(5000, 5064))
        for i in range(100):
            rid = f"replica-{i}"
            await sink.write_blocks(rid, BlockDelta(stored=set(prompt[:40] if i == 0 else prompt[:4])), ttl=60)
            await sink.write_state(ReplicaState(ReplicaInfo(rid, "http://x", "m", 16, 4096, 8, 1), ReplicaLoad()),
                                   60)
        index = RedisIndex(client)
        await index.snapshot([])
        stats = redis.Redis.from_url(redis_server.url)
        ranges = stats.info("commandstats").get("cmdstat_zrangebyscore", {}).get("calls", 0)
        states = await index.snapshot(prompt, min_blocks=10)
        read = stats.info("commandstats")["cmdstat_zrangebyscore"]["calls"] - ranges
        await index.close()
        await client.aclose()
        return {s.info.replica_id: s.matched_blocks for s in states if s.matched_blocks}, read

    matched, holder_reads = asyncio.run(scenario())
    assert matched == {"replica-0": 40} and holder_reads == 1


def test_a_burst_of_decisions_never_empties_the_connection_pool(redis_server):
    """400 decisions and claims at once on a client of 16 connections, each reply awaited while the loop is
    busy with the others (as a router in a burst): every read is made (none fails for want of a connection,
    none goes on load only), because decisions take a slot below the pool's size first."""
    from services.router.redis_index import RESERVED_CONNECTIONS

    async def scenario():
        client = connect(redis_server.url, max_connections=16)
        sink = RedisSink(client)
        prompt = list(range(5000, 5064))
        info = ReplicaInfo("a", "http://a", "m", 16, 4096, 8, 1)
        await sink.write_blocks("a", BlockDelta(stored=set(prompt[:40])), ttl=60)
        await sink.write_state(ReplicaState(info, ReplicaLoad()), 60)
        index = RedisIndex(client)
        await index.snapshot([])
        assert index.slots._value == 16 - RESERVED_CONNECTIONS

        async def decide(k: int):
            states = await index.snapshot(prompt)
            await index.claim("a", prompt, 40)
            busy_until = asyncio.get_running_loop().time() + 0.002
            while asyncio.get_running_loop().time() < busy_until:  # a busy event loop between replies
                pass
            return {s.info.replica_id: s.matched_blocks for s in states}

        results = await asyncio.gather(*(decide(k) for k in range(400)), return_exceptions=True)
        await index.close()
        await client.aclose()
        return results

    results = asyncio.run(scenario())
    assert [r for r in results if isinstance(r, BaseException)] == []
    wrong = [r for r in results if r != {"a": 40}]
    assert not wrong, f"{len(wrong)} of {len(results)} decisions saw {wrong[:3]}"
