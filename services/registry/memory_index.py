"""The registry and prefix index of `pagedserve serve`: the Redis layout, kept in this process's memory.

It is both the sink the scheduler's publisher writes to and the index the router reads, so the one-
process mode runs the very routing code of a cluster, without Redis; it files and searches the same
chain positions (services.registry.index_grid).
"""

from __future__ import annotations

import time

from services.registry.index_grid import filed_positions
from services.registry.model import BlockDelta, ReplicaState, split_holders

CLAIM_TTL = 10.0


class MemoryIndex:
    def __init__(self) -> None:
        self._states: dict[str, tuple[ReplicaState, float]] = {}  # id -> (state, expiry)
        self._blocks: dict[str, set[int]] = {}
        self._pending: dict[str, dict[int, float]] = {}  # id -> hash -> expiry
        self._tokenizers: dict[str, bytes] = {}
        self.catalog_version = 0  # bumped when a replica joins, leaves or changes what it serves
        # Keyed when written: a publisher may change its info object in place (an adapter loaded).
        self._catalog: dict[str, tuple] = {}

    async def write_tokenizer(self, digest: str, bundle: bytes) -> None:
        self._tokenizers[digest] = bundle

    async def tokenizer(self, digest: str) -> bytes | None:
        return self._tokenizers.get(digest)

    # -- sink (scheduler side) ---------------------------------------------------------------------
    async def write_state(self, state: ReplicaState, ttl: float) -> None:
        key = state.info.catalog_key()
        if self._catalog.get(state.info.replica_id) != key:
            self._catalog[state.info.replica_id] = key
            self.catalog_version += 1
        self._states[state.info.replica_id] = (state, time.monotonic() + ttl)

    async def write_blocks(self, replica_id: str, delta: BlockDelta, ttl: float) -> None:
        blocks = self._blocks.setdefault(replica_id, set())
        blocks |= delta.stored
        blocks -= delta.removed

    async def replace_blocks(self, replica_id: str, blocks: set[int], ttl: float) -> None:
        self._blocks[replica_id] = set(blocks)
        self._pending.pop(replica_id, None)

    async def remove_replica(self, replica_id: str) -> None:
        if self._states.pop(replica_id, None) is not None:
            self._catalog.pop(replica_id, None)
            self.catalog_version += 1
        self._blocks.pop(replica_id, None)
        self._pending.pop(replica_id, None)

    # -- index (router side) -----------------------------------------------------------------------
    async def snapshot(self, block_hashes: list[int], min_blocks: int = 1) -> list[ReplicaState]:
        now = time.monotonic()
        out = []
        for rid, (state, expiry) in list(self._states.items()):
            if expiry < now:
                del self._states[rid]
                self._catalog.pop(rid, None)
                self.catalog_version += 1
                continue
            blocks = self._blocks.get(rid, set())
            pending = self._pending.get(rid, {})
            n = 0
            for p in filed_positions(0, len(block_hashes)):
                h = block_hashes[p]
                if h not in blocks and pending.get(h, 0.0) <= now:
                    break
                n = p + 1
            out.append(ReplicaState(state.info, state.load, n))
        return out

    async def lookup(self, block_hashes: list[int], min_blocks: int = 1
                     ) -> tuple[list[ReplicaState], list[ReplicaState]]:
        """(every live replica, matches 0; those holding part of the prompt, with their matches)."""
        return split_holders(await self.snapshot(block_hashes, min_blocks))

    async def claim(self, replica_id: str, block_hashes: list[int], held: int = 0) -> None:
        now = time.monotonic()
        pending = self._pending.setdefault(replica_id, {})
        for h in [h for h, exp in pending.items() if exp <= now]:
            del pending[h]
        for p in filed_positions(held, len(block_hashes)):
            pending[block_hashes[p]] = now + CLAIM_TTL

    async def close(self) -> None:
        pass
