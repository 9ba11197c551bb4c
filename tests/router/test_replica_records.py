"""The router's copy of the replica records: a refresh reads only the records that changed (the registry's
change stream), on a real redis-server and a real Redis Cluster; a full read still catches expiries."""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.registry import keys
from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
from services.registry.redis_sink import RedisSink, connect
from services.router import replica_records
from services.router.replica_records import ReplicaRecords


def state(rid: str, running: int = 0) -> ReplicaState:
    return ReplicaState(ReplicaInfo(rid, f"http://{rid}", "m", 16, 4096, 8, 1), ReplicaLoad(0, running))


async def registered(url: str, ids=("a",)) -> tuple:
    """A client, a sink that wrote these replicas' records, and records that have read them (refreshed
    only by hand)."""
    client = connect(url)
    sink = RedisSink(client)
    for rid in ids:
        await sink.write_state(state(rid), ttl=60)
    records = ReplicaRecords(client, keys.DEFAULT_NAMESPACE, None, refresh=3600)
    await records.read()
    return client, sink, records


async def _scenario(url: str):
    client, sink, records = await registered(url, [f"r{i:02d}" for i in range(50)])
    assert len(records.states) == 50
    await sink.write_state(state("r07", running=5), ttl=60)
    await sink.write_state(state("r99"), ttl=60)  # a new replica
    await sink.remove_replica("r13")  # a replica that left
    await records.refresh_changed()
    by_id = {s.info.replica_id: s for s in records.states}
    assert by_id["r07"].load.num_running == 5 and "r99" in by_id and "r13" not in by_id and len(by_id) == 50
    assert [s.info.replica_id for s in records.states] == sorted(by_id)
    assert records.position == {rid: i for i, rid in enumerate(sorted(by_id))}
    await records.refresh_changed()  # nothing changed: nothing read
    await client.aclose()
    return records


def test_a_refresh_reads_only_what_changed(redis_server):
    asyncio.run(_scenario(redis_server.url))
    # The same again, counting records read: one changed record costs one key, not fifty.
    redis_server.flush()

    async def counted():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        for i in range(50):
            await sink.write_state(state(f"r{i:02d}"), ttl=60)
        records = ReplicaRecords(client, keys.DEFAULT_NAMESPACE, None, refresh=3600)
        await records.read()
        await sink.write_state(state("r03", running=2), ttl=60)
        before = redis.Redis.from_url(redis_server.url).info("commandstats").get("cmdstat_mget", {})
        await records.refresh_changed()
        after = redis.Redis.from_url(redis_server.url).info("commandstats").get("cmdstat_mget", {})
        await client.aclose()
        return after.get("calls", 0) - before.get("calls", 0), records

    calls, records = asyncio.run(counted())
    assert calls == 1 and {s.info.replica_id: s for s in records.states}["r03"].load.num_running == 2


def test_the_change_feed_works_on_a_cluster(redis_cluster):
    asyncio.run(_scenario(redis_cluster.url))


def test_an_expired_record_goes_at_the_next_full_read(redis_server, monkeypatch):
    async def scenario():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        await sink.write_state(state("alive"), ttl=60)
        await sink.write_state(state("dying"), ttl=0.2)  # it dies: no change is ever written for it
        records = ReplicaRecords(client, keys.DEFAULT_NAMESPACE, None, refresh=3600)
        await records.read()
        assert len(records.states) == 2
        await asyncio.sleep(0.4)
        await records.refresh_changed()
        assert len(records.states) == 2  # not yet: no change says so
        monkeypatch.setattr(replica_records, "FULL_READ_EVERY", 0.0)
        await records.refresh_changed()
        assert [s.info.replica_id for s in records.states] == ["alive"]
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["redis_server", "redis_cluster"])
def test_a_full_read_is_one_exists_while_every_record_lives(where, request, monkeypatch):
    """Checking for dead replicas costs one EXISTS (an integer back), not every record's bytes."""
    url = request.getfixturevalue(where).url

    async def scenario():
        client, _, records = await registered(url, [f"r{i:02d}" for i in range(30)])
        monkeypatch.setattr(replica_records, "FULL_READ_EVERY", 0.0)
        reads = []
        real = records._read_ids

        async def counting(ids):
            reads.append(len(ids))
            return await real(ids)

        records._read_ids = counting
        await records.refresh_changed()
        assert reads == [] and len(records.states) == 30
        await client.delete(keys.replica_key(keys.DEFAULT_NAMESPACE, "r05"))  # gone without a change
        await records.refresh_changed()
        assert reads == [30] and "r05" not in records.position and len(records.states) == 29
        await client.aclose()

    asyncio.run(scenario())


def test_a_router_behind_a_trimmed_stream_reads_everything(redis_server):
    async def scenario():
        client, sink, records = await registered(redis_server.url)
        await sink.write_state(state("b"), ttl=60)
        await sink.write_state(state("a", running=3), ttl=60)
        # Trim the stream past this router's position (as MAXLEN does when it falls far behind).
        await client.xtrim(keys.changes_key(keys.DEFAULT_NAMESPACE), maxlen=0)
        await sink.write_state(state("c"), ttl=60)
        await records.refresh_changed()
        by_id = {s.info.replica_id: s for s in records.states}
        assert set(by_id) == {"a", "b", "c"} and by_id["a"].load.num_running == 3
        await client.aclose()

    asyncio.run(scenario())


def test_the_catalog_version_moves_with_what_replicas_serve_not_with_their_load(redis_server):
    async def scenario():
        client, sink, records = await registered(redis_server.url)
        seen = [records.catalog_version]

        async def after(write) -> bool:
            await write
            await records.refresh_changed()
            seen.append(records.catalog_version)
            return seen[-1] != seen[-2]

        assert not await after(sink.write_state(state("a", running=4), ttl=60))  # load only
        with_adapter = state("a")
        with_adapter.info.adapters = {"sql": "d1"}
        assert await after(sink.write_state(with_adapter, ttl=60))  # an adapter became resident
        assert not await after(sink.write_state(with_adapter, ttl=60))
        assert await after(sink.write_state(state("b"), ttl=60))  # a replica joined
        assert await after(sink.remove_replica("b"))  # and left
        await records.read()  # a full read of the same records changes nothing
        assert records.catalog_version == seen[-1]
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("a,b,newer", [("5-0", "4-9", True), ("5-1", "5-0", True), ("5-0", "5-0", False),
                                        ("10-0", "9-0", True)])
def test_stream_ids_compare_as_numbers(a, b, newer):
    assert replica_records._newer(a, b) is newer


def test_close_stops_the_loop_even_when_the_client_turns_cancellation_into_an_error(redis_server):
    """redis-py's pool can answer a cancellation with an error; the loop must still end on close (it once
    refreshed on forever and close() waited for it)."""

    async def scenario():
        client, _, records = await registered(redis_server.url)
        records.refresh = 0.01
        entered = asyncio.Event()

        async def stuck() -> None:
            entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise ConnectionError("Connection closed by server.") from None

        records.refresh_changed = stuck
        await records.current()  # starts the loop
        await asyncio.wait_for(entered.wait(), 5)
        task = records._task
        await asyncio.wait_for(records.close(), 5)
        assert task.done()
        await client.aclose()

    asyncio.run(scenario())


def test_a_changed_record_takes_its_predecessors_place(redis_server):
    """A refresh of known replicas replaces them in place: positions stand, generations and the catalog
    follow the new records."""

    async def scenario():
        client, sink, records = await registered(redis_server.url, ("a", "b", "c"))
        position, version = dict(records.position), records.catalog_version
        await sink.replace_blocks("b", {1, 2}, ttl=60)  # b resyncs: a new generation in its next record
        await sink.write_state(state("b", running=4), ttl=60)
        await records.refresh_changed()
        b = records.states[records.position["b"]]
        assert records.position == position and b.load.num_running == 4 and b.info.generation
        assert records.by_generation == {b.info.generation: "b"}
        version = records.catalog_version  # a new generation is a new adapter holder: the catalog may move
        await sink.write_state(state("a", running=2), ttl=60)  # a load change alone does not move it
        await records.refresh_changed()
        assert records.catalog_version == version
        renamed = ReplicaState(ReplicaInfo("c", "http://c", "other-model", 16, 4096, 8, 1), ReplicaLoad(0, 0))
        await sink.write_state(renamed, ttl=60)
        await records.refresh_changed()
        assert records.catalog_version == version + 1
        assert records.states[records.position["c"]].info.model == "other-model"
        await client.aclose()

    asyncio.run(scenario())
