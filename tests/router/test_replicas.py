"""The router's registry view through a Redis outage: the last good view serves while Redis is down,
and also while it is back but still empty, until the replicas' next heartbeats re-register them."""

from __future__ import annotations

import asyncio

from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
from services.router import replicas
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaView


class FlakyIndex:
    def __init__(self):
        self.mode = "up"
        self.state = ReplicaState(ReplicaInfo("a", "http://127.0.0.1:1", "m", 16, 2048, 8, 1), ReplicaLoad())

    async def snapshot(self, block_hashes, min_blocks=1):
        if self.mode == "down":
            raise ConnectionError("Redis is down")
        return [self.state] if self.mode == "up" else []

    async def claim(self, replica_id, block_hashes, held=0):
        pass


def test_an_empty_registry_right_after_an_outage_does_not_empty_the_view(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(replicas.time, "monotonic", lambda: clock[0])
    index = FlakyIndex()
    view = ReplicaView(index, RouterMetrics())

    async def ids() -> list[str]:
        return [s.info.replica_id for s in await view.snapshot([])]

    async def main():
        assert await ids() == ["a"]
        index.mode, clock[0] = "down", clock[0] + 1
        assert await ids() == ["a"]  # down: the last view serves
        clock[0] += 20  # a long outage, far past the empty-registry grace since the last good read
        index.mode = "empty"  # Redis is back, restarted empty; replicas re-register at their next beat
        assert await ids() == ["a"]
        clock[0] += replicas.EMPTY_GRACE - 1
        assert await ids() == ["a"]
        clock[0] += 2  # still empty well after it came back: the replicas really are gone
        assert await ids() == []

    asyncio.run(main())


class CountingIndex(FlakyIndex):
    """An index offering catalog_version: the view re-derives its model names only when it moves."""

    def __init__(self):
        super().__init__()
        self.catalog_version = 0


def test_model_names_are_re_derived_only_when_the_catalog_version_moves(monkeypatch):
    index = CountingIndex()
    view = ReplicaView(index, RouterMetrics())
    derived = []
    real = view._derive_catalog
    monkeypatch.setattr(view, "_derive_catalog", lambda: (derived.append(1), real()))

    async def main():
        assert (await view.resolve("m")).adapter is None
        for _ in range(5):  # decisions with load changes only
            await view.snapshot([])
        assert len(derived) == 1
        index.state.info.adapters = {"sql": "d1"}
        index.catalog_version += 1
        await view.snapshot([])
        assert len(derived) == 2 and (await view.resolve("sql")).adapter_digest == "d1"

    asyncio.run(main())


def test_the_load_orders_follow_the_records_refresh_not_the_next_decision(redis_server):
    """At fleet scale a refresh brings hundreds of load changes: the view moves them in its load orders as
    the records swap them in (a chunk at a time), so the next decision finds nothing left to sort."""
    from services.registry import keys
    from services.registry.redis_sink import RedisSink, connect
    from services.router.policies import RANKED
    from services.router.redis_index import RedisIndex

    async def main():
        client = connect(redis_server.url)
        sink = RedisSink(client)
        infos = [ReplicaInfo(f"r{i:02d}", f"http://r{i}", "m", 16, 4096, 8, 1) for i in range(60)]
        for info in infos:
            await sink.write_state(ReplicaState(info, ReplicaLoad(0, 5)), ttl=60)
        index = RedisIndex(client, keys.DEFAULT_NAMESPACE, record_refresh=3600)
        view = ReplicaView(index, RouterMetrics())
        identity = infos[0].identity
        await view.shortlist([], 1, identity, RANKED)
        sizes = []
        real = view._orders.update
        view._orders.update = lambda states, changed=None: (sizes.append(None if changed is None else len(changed)),
                                                            real(states, changed))[1]
        for info in infos[::3]:  # 20 replicas go idle
            await sink.write_state(ReplicaState(info, ReplicaLoad(0, 0)), ttl=60)
        await index.records.refresh_changed()
        assert sizes and sum(sizes) == 20  # followed during the refresh, a swap at a time
        sizes.clear()
        short, _ = await view.shortlist([], 1, identity, RANKED)
        assert sizes in ([], [0])  # the decision found the orders current
        assert {s.info.replica_id for s in short} <= {i.replica_id for i in infos[::3]}
        assert all(s.load.requests == 0 for s in short)
        await index.close()
        await client.aclose()

    asyncio.run(main())
