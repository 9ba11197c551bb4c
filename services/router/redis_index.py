"""The router's prefix index on Redis (one node or a cluster): which replicas hold a prompt's leading blocks.

The index is inverted (services.registry.keys: block hash -> generations holding it), and a replica's
cached set is prefix-closed along each hash chain (its engine evicts a sequence's tail before its
prefix, and a router claims a prompt's blocks together). So the number of replicas holding block i of a
prompt never grows with i, and the longest cached prefix is found by a K-ary search over the prompt's
chained hashes: a few pipelined ZCOUNTs per round, O(log_K prompt blocks) rounds (first over every
STRIDE-th block, where claims are filed, then within one stride). The holders of that
prefix are then read from one key, and the search goes on to the next shallower prefix that more
replicas hold (up to LEVELS depths, so a busy holder of the longest prefix has exact runners-up); dead
replicas and superseded generations among the holders are skipped by the router. Work per decision
is O(prompt blocks) at worst and never depends on the number of replicas; replica records and load come
from ReplicaRecords, in memory.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from services.registry import keys
from services.registry.model import ReplicaState, Signer
from services.router.replica_records import ReplicaRecords

# Enough for a 64k-token prompt at block size 16.
MAX_HASHES = 4096
CLAIM_TTL_MS = 10_000
PROBES = 4  # ZCOUNTs per search round: 16 cost a third more Redis CPU per decision for one round trip less
STRIDE = 8  # claims are filed on every STRIDE-th block: a claimed prefix is found to within STRIDE blocks
LEVELS = 3  # distinct prefix depths read per decision (the deepest with a live holder is what counts)
HOLDERS = 64  # holders read at one depth: beyond that, a deterministic subset (any of them is as good)
RECORD_REFRESH = 0.25


class RedisIndex:
    def __init__(self, client: Redis, namespace: str = keys.DEFAULT_NAMESPACE, signer: Signer | None = None,
                 record_refresh: float = RECORD_REFRESH):
        self.client = client
        self.ns = namespace
        self.records = ReplicaRecords(client, namespace, signer, record_refresh)

    @property
    def catalog_version(self) -> int:
        return self.records.catalog_version

    async def snapshot(self, block_hashes: list[int], min_blocks: int = 1) -> list[ReplicaState]:
        await self.records.current()
        # One consistent set of records for this decision: a background refresh may swap them meanwhile.
        states, position, by_generation = self.records.states, self.records.position, self.records.by_generation
        hashes = block_hashes[:MAX_HASHES]
        if not hashes or not states:
            return list(states)
        out = list(states)
        for i, n in (await self.matches(hashes, position, by_generation, min_blocks)).items():
            out[i] = ReplicaState(out[i].info, out[i].load, n)
        return out

    async def matches(self, hashes: list[int], position: dict[str, int],
                      by_generation: dict[int, str], min_blocks: int = 1) -> dict[int, int]:
        """Position of a live replica in the records -> leading blocks of the prompt it holds (or was
        claimed for), for the holders of up to LEVELS distinct prefix depths of at least `min_blocks`,
        deepest first; replicas not named hold less (or nothing). A shallow prefix every replica holds (a
        shared chat-template header) is never read: its holders are the whole fleet."""
        now = int(time.time() * 1000)
        counts: dict[int, int] = {}
        found: dict[int, int] = {}
        hi, floor = len(hashes), 0
        for _ in range(LEVELS):
            depth = await self._deepest(hashes, hi, floor, counts, now)
            if depth < max(0, min_blocks - 1):
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

    async def _deepest(self, hashes: list[int], hi: int, floor: int, counts: dict[int, int], now: int) -> int:
        """The deepest position below hi whose block more than `floor` generations hold (-1: none), given
        that counts never grow with depth: first on the claim grid, then between two grid positions."""
        grid = list(range(STRIDE - 1, hi, STRIDE))
        g = await self._search(hashes, grid, floor, counts, now)
        gap = list(range(g + 1, min(g + STRIDE, hi)))
        deeper = await self._search(hashes, gap, floor, counts, now)
        return max(g, deeper)

    async def _search(self, hashes: list[int], cand: list[int], floor: int, counts: dict[int, int], now: int) -> int:
        """K-ary search along positions `cand` (counts non-increasing along it): PROBES ZCOUNTs per round."""
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
        """File the prompt's blocks from `held` on under the replica's generation until they expire, on the
        claim grid (every STRIDE-th block and the last: the search probes the grid first) so any router's
        next request with this prefix follows it. A stored entry stays stored: ZADD GT never lowers +inf."""
        i = self.records.position.get(replica_id)
        gen = self.records.states[i].info.generation if i is not None else 0
        hashes = block_hashes[:MAX_HASHES]
        positions = [p for p in range(held, len(hashes)) if p % STRIDE == STRIDE - 1 or p == len(hashes) - 1]
        if not positions or not gen:
            return
        expiry = int(time.time() * 1000) + CLAIM_TTL_MS
        pipe = self.client.pipeline(transaction=False)
        for p in positions:
            pipe.zadd(keys.block_key(self.ns, hashes[p]), {str(gen): expiry}, gt=True)
        await pipe.execute()

    async def tokenizer(self, digest: str) -> bytes | None:
        """The tokenizer bundle published under `digest` (unverified: the caller checks it against the
        digest in a signed record), or None."""
        return await self.client.get(keys.tokenizer_key(self.ns, digest))

    async def close(self) -> None:
        await self.records.close()
