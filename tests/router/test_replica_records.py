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
    # The same again, counting records read: a load change costs none (the entry carries it), a changed
    # record one key, not fifty.
    redis_server.flush()

    async def counted():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        for i in range(50):
            await sink.write_state(state(f"r{i:02d}"), ttl=60)
        records = ReplicaRecords(client, keys.DEFAULT_NAMESPACE, None, refresh=3600)
        await records.read()
        mgets = []
        for change in (state("r03", running=2), _moved(state("r04", running=1))):
            await sink.write_state(change, ttl=60)
            before = redis.Redis.from_url(redis_server.url).info("commandstats").get("cmdstat_mget", {})
            await records.refresh_changed()
            after = redis.Redis.from_url(redis_server.url).info("commandstats").get("cmdstat_mget", {})
            mgets.append(after.get("calls", 0) - before.get("calls", 0))
        await client.aclose()
        return mgets, records

    mgets, records = asyncio.run(counted())
    by_id = {s.info.replica_id: s for s in records.states}
    assert mgets == [0, 1]
    assert by_id["r03"].load.num_running == 2 and by_id["r04"].info.url == "http://moved"


def _moved(s: ReplicaState) -> ReplicaState:
    return ReplicaState(ReplicaInfo(s.info.replica_id, "http://moved", "m", 16, 4096, 8, 1), s.load)


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


def test_the_journal_names_what_each_swap_changed(redis_server):
    """A refresh of many known replicas swaps them in a chunk at a time (loads from the change entries,
    records as they are parsed), each swap noted, so a reader catches up on exactly the replicas that
    changed; a join, a leave or a rejected record says 'unknown'."""

    async def scenario():
        ids = [f"r{i:02d}" for i in range(60)]
        client, sink, records = await registered(redis_server.url, ids)
        start = records.version
        assert records.changed_since(start) == [] and records.changed_since(-1) is None
        swaps = []
        real = records._replace
        records._replace = lambda fresh: (swaps.append(len(fresh)), real(fresh))
        loads = ids[:40]  # only their loads move, twice: applied from the entries, a batch per swap
        entries = [(rid, running) for running in (2, 3) for rid in loads]
        for rid, running in entries:
            await sink.write_state(state(rid, running=running), ttl=60)
        await records.refresh_changed()
        batch = replica_records.LOAD_CHUNK
        batches = [entries[i:i + batch] for i in range(0, len(entries), batch)]
        assert len(batches) > 1 and swaps == [len({rid for rid, _ in b}) for b in batches]
        changed = records.changed_since(start)
        assert sorted(s.info.replica_id for s in changed) == loads
        assert all(s is records.states[records.position[s.info.replica_id]] and s.load.num_running == 3
                   for s in changed)
        later = {rid for b in batches[1:] for rid, _ in b}  # owed only the later swaps' replicas
        assert {s.info.replica_id for s in records.changed_since(start + 1)} == later
        here, swaps[:] = records.version, []
        moved = ids[40:]  # their records change: read, and swapped PARSE_CHUNK at a time
        for rid in moved:
            await sink.write_state(_moved(state(rid)), ttl=60)
        await records.refresh_changed()
        assert swaps == [replica_records.PARSE_CHUNK] * (len(moved) // replica_records.PARSE_CHUNK)
        assert sorted(s.info.replica_id for s in records.changed_since(here)) == moved
        here = records.version
        await sink.remove_replica("r05")
        await records.refresh_changed()
        assert records.changed_since(here) is None and records.changed_since(start) is None
        here = records.version
        await client.set(keys.replica_key(keys.DEFAULT_NAMESPACE, "r07"), b"not json")  # a forged record
        await client.xadd(keys.changes_key(keys.DEFAULT_NAMESPACE), {"r": "r07"})
        await records.refresh_changed()
        assert records.changed_since(here) is None and "r07" not in records.position
        await client.aclose()

    asyncio.run(scenario())


def test_a_load_in_the_change_stream_is_trusted_only_when_signed_for_that_replica_and_generation(redis_server):
    """With the internal token, a load entry is applied only if its HMAC covers this replica, its current
    generation and this load; anything else (no signature, another token, another replica's or generation's
    signed load, a malformed load) makes the router read the signed record instead, whose load wins."""
    from services.contracts.internal_auth import InternalToken
    from services.registry.change_entry import load_payload

    token = InternalToken.generate()

    async def scenario():
        client = connect(redis_server.url)
        sink = RedisSink(client, signer=token)
        for rid in ("a", "b"):
            await sink.write_state(state(rid), ttl=60)
        await sink.replace_blocks("a", {1}, ttl=60)  # "a" files blocks: its record names a generation
        await sink.write_state(state("a"), ttl=60)
        records = ReplicaRecords(client, keys.DEFAULT_NAMESPACE, token, refresh=3600)
        await records.read()
        gen = records.states[records.position["a"]].info.generation
        assert gen
        await sink.write_state(state("a", running=2), ttl=60)  # a genuine load entry: applied inline
        mget = _counter(redis_server.url, "mget")
        await records.refresh_changed()
        assert mget() == 0 and records.states[records.position["a"]].load.num_running == 2

        stream = keys.changes_key(keys.DEFAULT_NAMESPACE)
        good_b = ReplicaLoad(0, 4).to_compact()
        forged = [
            {"r": "a", "l": ReplicaLoad(0, 7).to_compact(), "g": str(gen)},  # unsigned
            {"r": "a", "l": "0,7,0.0,1,0", "g": str(gen),
             "s": InternalToken.generate().sign(load_payload("a", gen, "0,7,0.0,1,0"))},  # another token
            {"r": "a", "l": good_b, "g": str(gen), "s": token.sign(load_payload("b", 0, good_b))},  # b's
            {"r": "a", "l": "0,7,0.0,1,0", "g": str(gen + 1),
             "s": token.sign(load_payload("a", gen + 1, "0,7,0.0,1,0"))},  # a generation it does not hold
            {"r": "a", "l": "0,-7,nan,1,0", "g": str(gen), "s": token.sign(load_payload("a", gen, "0,-7,nan,1,0"))},
        ]
        for entry in forged:
            await client.xadd(stream, entry)
            await records.refresh_changed()
            # The record was read instead: its load (2 running) stands, not the entry's 7.
            assert mget() == 1, entry
            assert records.states[records.position["a"]].load.num_running == 2
        await client.aclose()

    asyncio.run(scenario())


def _counter(url: str, command: str):
    """A function returning how many times `command` ran since the last call."""
    r = redis.Redis.from_url(url)
    last = [r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)]

    def since() -> int:
        now = r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)
        out, last[0] = now - last[0], now
        return out
    return since


def test_garbage_in_the_registry_costs_the_router_nothing_but_that_entry(redis_server):
    """Bytes no writer of ours puts there (not UTF-8) in the replica set and in the change stream: the
    records still read and refresh, and a genuine change after them is applied."""

    async def scenario():
        client, sink, records = await registered(redis_server.url, ("a",))
        stream = keys.changes_key(keys.DEFAULT_NAMESPACE)
        await client.xadd(stream, {b"r": b"\x80", b"l": b"\xff"})
        await client.xadd(stream, {b"r": b"a", b"l": b"\x80", b"g": b"0"})
        await sink.write_state(state("a", running=6), ttl=60)
        await records.refresh_changed()  # the garbage entries first, then the genuine one
        assert records.states[records.position["a"]].load.num_running == 6
        await client.sadd(keys.replicas_key(keys.DEFAULT_NAMESPACE), b"\xff\xfe")
        await records.read()
        assert [s.info.replica_id for s in records.states] == ["a"]
        await client.aclose()

    asyncio.run(scenario())
