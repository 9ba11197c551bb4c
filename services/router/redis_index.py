"""The router's prefix index on Redis (one node or a cluster): which replicas hold a prompt's leading blocks.

The index is inverted (services.registry.keys: block hash -> generations holding it) and files only the
chain positions of services.registry.index_grid. A replica's cached set is prefix-closed along each hash
chain (its engine evicts a sequence's tail before its prefix, and a router claims a prompt's blocks
together), so the number of replicas holding the block at position i of a prompt never grows with i, and
the deepest filed position held is found by a K-ary search over the prompt's filed positions: PROBES
pipelined ZCOUNTs per round, O(log_PROBES prompt blocks) rounds. The holders of that prefix are then read
from one key, and the search goes on to the next shallower prefix that more replicas hold (up to LEVELS
depths, so a busy holder of the longest prefix has exact runners-up); dead replicas and superseded
generations among the holders are skipped by the router. Work per decision is O(prompt blocks) at worst
and never depends on the number of replicas; replica records and load come from ReplicaRecords, in memory.

A burst must not empty the client's connection pool: every decision's block reads and every claim hold
one of the pool's connections at a time, and a burst of hundreds of decisions at once (each waiting on a
busy event loop for its reply) asked for more than the pool holds, so reads failed with "No connection
available" and those requests went on load only. Decisions and claims now take a slot first (the pool's
size less RESERVED_CONNECTIONS, which the records' refresh keeps): past that they wait their turn, at
most SLOT_WAIT seconds (IndexBusy then: that decision alone goes on load only; Redis is not down).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis

from services.registry import keys
from services.registry.index_grid import GRID, IndexGrid
from services.registry.model import ReplicaState, Signer, with_holders
from services.router.replica_records import ReplicaRecords

# Enough for a 64k-token prompt at block size 16.
MAX_HASHES = 4096
CLAIM_TTL_MS = 10_000
PROBES = 16  # ZCOUNTs per search round: a prompt's filed positions past the policy's threshold, up to 16
# (a 2,000-token prompt), in one round trip; 4 took three more round trips, ~0.5 ms of router CPU per decision
# here (redis-py and asyncio per round trip), for ~5 ZCOUNTs less
LEVELS = 3  # distinct prefix depths read per decision (the deepest with a live holder is what counts)
HOLDERS = 64  # holders read at one depth: beyond that, a deterministic subset (any of them is as good)
RECORD_REFRESH = 0.25
RESERVED_CONNECTIONS = 8  # of the pool, left to the records' refresh (never waiting behind decisions)
SLOT_WAIT = 10.0  # seconds a decision or claim may wait for a connection slot (a burst queues here, as it
# would in the router's admission queue) before that one read goes without the index
DEFAULT_POOL = 128  # services.registry.redis_connect.connect's


class IndexBusy(TimeoutError):
    """Every connection slot stayed taken for SLOT_WAIT: this read goes without the index (Redis is up)."""


def pool_size(client) -> int:
    """Connections the client may open (per node on a cluster)."""
    pool = getattr(client, "connection_pool", None)
    size = getattr(pool, "max_connections", None)
    if size is None:
        size = getattr(client, "connection_kwargs", {}).get("max_connections")
    return int(size or DEFAULT_POOL)


class RedisIndex:
    def __init__(self, client: Redis, namespace: str = keys.DEFAULT_NAMESPACE, signer: Signer | None = None,
                 record_refresh: float = RECORD_REFRESH, grid: IndexGrid = GRID):
        self.client = client
        self.grid = grid  # the positions the publishers file
        self.ns = namespace
        self.records = ReplicaRecords(client, namespace, signer, record_refresh)
        self.slots = asyncio.Semaphore(max(1, pool_size(client) - RESERVED_CONNECTIONS))

    async def _slot(self) -> None:
        try:
            await asyncio.wait_for(self.slots.acquire(), SLOT_WAIT)
        except asyncio.TimeoutError:
            raise IndexBusy(f"no connection slot free within {SLOT_WAIT:g} s") from None

    @property
    def catalog_version(self) -> int:
        return self.records.catalog_version

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each swap of the records (held weakly when it is a bound method: a view
        that goes away stops being called)."""
        self.records.watch(callback)

    def changes_since(self, version: int) -> tuple[int, list[ReplicaState], list[ReplicaState] | None]:
        """(the records' version now, every live replica now, those changed after `version`, or None when
        that is unknown): what a reader's own structure over the records needs to catch up in O(changes)."""
        records = self.records
        return records.version, records.states, records.changed_since(version)

    async def snapshot(self, block_hashes: list[int], min_blocks: int = 1) -> list[ReplicaState]:
        return with_holders(*await self.lookup(block_hashes, min_blocks))

    async def lookup(self, block_hashes: list[int], min_blocks: int = 1
                     ) -> tuple[list[ReplicaState], list[ReplicaState]]:
        """(every live replica, matches 0: the records' own list, the same object until they change, not to
        be modified; the holders of the prompt's prefix with their matches): what snapshot() returns, without
        a copy of the fleet per decision."""
        await self.records.current()
        states, position, by_generation = self.records.states, self.records.position, self.records.by_generation
        hashes = block_hashes[:MAX_HASHES]
        if not hashes or not states:
            return states, []
        await self._slot()
        try:
            found = await self.matches(hashes, position, by_generation, min_blocks)
        finally:
            self.slots.release()
        return states, [ReplicaState(states[i].info, states[i].load, n) for i, n in found.items()]

    async def matches(self, hashes: list[int], position: dict[str, int],
                      by_generation: dict[int, str], min_blocks: int = 1) -> dict[int, int]:
        """Position of a live replica in the records -> leading blocks of the prompt it holds (or was
        claimed for), for the holders of up to LEVELS distinct prefix depths of at least `min_blocks`,
        deepest first; replicas not named hold less (or nothing). A shallow prefix every replica holds (a
        shared chat-template header) is never read: its holders are the whole fleet."""
        now = int(time.time() * 1000)
        counts: dict[int, int] = {}
        found: dict[int, int] = {}
        # Positions shallower than the policy acts on are never probed: that is where a header every
        # replica holds lives, in keys with a member per replica.
        lo, hi, floor = max(0, min_blocks - 1), len(hashes), 0
        for _ in range(LEVELS):
            depth = await self._search(hashes, self.grid.filed_positions(lo, hi), floor, counts, now)
            if depth < 0:
                break
            members = await self.client.zrangebyscore(keys.block_key(self.ns, hashes[depth]), now, "+inf",
                                                      start=0, num=HOLDERS)
            for m in members:
                rid = by_generation.get(int(m))
                if rid is not None and position[rid] not in found:
                    found[position[rid]] = depth + 1
            if counts[depth] > HOLDERS:
                break
            hi, floor = depth, counts[depth]  # replicas holding a shorter prefix: the next level up
        return found

    async def _search(self, hashes: list[int], cand: list[int], floor: int, counts: dict[int, int], now: int) -> int:
        """The deepest of positions `cand` whose block more than `floor` generations hold (-1: none), given
        that counts never grow with depth: a K-ary search, PROBES ZCOUNTs per round."""
        lo, hi, best = 0, len(cand), -1
        while lo < hi:
            n = hi - lo
            idx = list(range(lo, hi)) if n <= PROBES else sorted({lo - (-(j + 1) * n // PROBES) - 1
                                                                   for j in range(PROBES)})
            await self._count(hashes, [cand[i] for i in idx if cand[i] not in counts], counts, now)
            hits = [i for i in idx if counts[cand[i]] > floor]
            if not hits:
                hi = idx[0]
                continue
            best = hits[-1]
            nxt = idx.index(best) + 1
            lo, hi = (hi, hi) if nxt == len(idx) else (best + 1, idx[nxt])
        return cand[best] if best >= 0 else -1

    async def _count(self, hashes: list[int], positions: list[int], counts: dict[int, int], now: int) -> None:
        if not positions:
            return
        pipe = self.client.pipeline(transaction=False)
        for p in positions:
            pipe.zcount(keys.block_key(self.ns, hashes[p]), now, "+inf")
        for p, c in zip(positions, await pipe.execute(), strict=True):
            counts[p] = int(c)

    async def claim(self, replica_id: str, block_hashes: list[int], held: int = 0) -> None:
        """File the prompt's blocks from `held` on (at the filed positions) under the replica's generation
        until they expire, so any router's next request with this prefix follows it. A stored entry stays
        stored: ZADD GT never lowers +inf."""
        i = self.records.position.get(replica_id)
        gen = self.records.states[i].info.generation if i is not None else 0
        hashes = block_hashes[:MAX_HASHES]
        positions = self.grid.filed_positions(held, len(hashes))
        if not positions or not gen:
            return
        expiry = int(time.time() * 1000) + CLAIM_TTL_MS
        pipe = self.client.pipeline(transaction=False)
        for p in positions:
            pipe.zadd(keys.block_key(self.ns, hashes[p]), {str(gen): expiry}, gt=True)
        await self._slot()
        try:
            await pipe.execute()
        finally:
            self.slots.release()

    async def tokenizer(self, digest: str) -> bytes | None:
        """The tokenizer bundle published under `digest` (unverified: the caller checks it against the
        digest in a signed record), or None."""
        return await self.client.get(keys.tokenizer_key(self.ns, digest))

    async def close(self) -> None:
        await self.records.close()
