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
