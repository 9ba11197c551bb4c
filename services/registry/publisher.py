"""A scheduler's registry loop: heartbeat with load, and the blocks it stores or evicts that the index files.

Of a chain's blocks only the positions of services.registry.index_grid are filed (the rest would cost the
index writes and keys without telling a router more than within STRIDE blocks). It keeps a mirror of the
replica's filed-block set, so an outage loses nothing: events keep being
absorbed while the sink is unreachable, and once it answers again the whole set is rewritten in one
transaction (Redis may have restarted empty). Load is published as soon as it changes, not only on the
heartbeat, because routers balance on it and keep no state of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from services.registry.index_grid import GRID, IndexGrid
from services.registry.model import BlockDelta, RegistrySink, ReplicaInfo, ReplicaLoad, ReplicaState

log = logging.getLogger(__name__)


class ReplicaSource(Protocol):
    """What the publisher reads from the replica it speaks for."""

    def load(self) -> ReplicaLoad: ...

    def drain_kv_events(self) -> list:  # of objects with .kind ("stored"|"removed"), .block_hashes, .positions
        ...


class ReplicaPublisher:
    def __init__(self, sink: RegistrySink, info: ReplicaInfo, source: ReplicaSource,
                 heartbeat_interval: float = 1.0, event_interval: float = 0.02, tokenizer_bundle: bytes | None = None,
                 grid: IndexGrid = GRID):
        """`tokenizer_bundle`: the replica's tokenizer files (services.model_files.tokenizer.read_bundle),
        published under info.tokenizer_digest so routers need no copy of the model. `grid`: the positions
        filed (the routers' must be the same)."""
        self.grid = grid
        self.sink = sink
        self.tokenizer_bundle = tokenizer_bundle
        self.info = info
        self.source = source
        self.heartbeat_interval = heartbeat_interval
        self.event_interval = event_interval
        self.ttl = max(3 * heartbeat_interval, 1.0)
        self._mirror: set[int] = set()  # the filed blocks it holds
        self._num_cached = 0  # every block it holds, filed or not
        self._delta = BlockDelta()
        self._resync = True  # first publish replaces whatever a previous run with this id left behind
        self._last_load: ReplicaLoad | None = None
        self._last_beat = 0.0
        self._failing = False
        self._stopped = asyncio.Event()
        self._lock = asyncio.Lock()  # close() must not race a tick that would re-register the replica

    async def run(self) -> None:
        while not self._stopped.is_set():
            try:
                async with self._lock:
                    if self._stopped.is_set():
                        break
                    await self.tick()
            except Exception as exc:
                if not self._failing:
                    log.warning("registry unreachable for replica %s (%s: %s); retrying, will resync",
                                self.info.replica_id, type(exc).__name__, exc)
                self._failing = True
                self._resync = True
                self._last_load = None  # re-register as soon as the sink answers again
            else:
                if self._failing:
                    log.info("registry reachable again for replica %s; block set resynced",
                             self.info.replica_id)
                self._failing = False
            try:
                await asyncio.wait_for(self._stopped.wait(), self.event_interval)
            except asyncio.TimeoutError:
                pass

    async def tick(self) -> None:
        self._absorb(self.source.drain_kv_events())
        load = self.source.load()
        load.cached_blocks = self._num_cached
        resynced = self._resync
        if self._resync:
            if self.tokenizer_bundle is not None and self.info.tokenizer_digest:
                await self.sink.write_tokenizer(self.info.tokenizer_digest, self.tokenizer_bundle)
            # Blocks first, then the record that names their generation (services.registry.keys).
            await self.sink.replace_blocks(self.info.replica_id, set(self._mirror), self.ttl)
            self._resync, self._delta = False, BlockDelta()
        elif self._delta:
            delta, self._delta = self._delta, BlockDelta()
            await self.sink.write_blocks(self.info.replica_id, delta, self.ttl)
        now = time.monotonic()
        if resynced or self._load_changed(load) or now - self._last_beat >= self.heartbeat_interval:
            await self.sink.write_state(ReplicaState(self.info, load), self.ttl)
            self._last_load, self._last_beat = load, now

    def reset_blocks(self) -> None:
        """The engine restarted with an empty KV cache: this replica caches nothing any more."""
        self._mirror.clear()
        self._num_cached = 0
        self._delta = BlockDelta()
        self._resync = True

    async def close(self) -> None:
        self._stopped.set()
        try:
            async with self._lock:
                await self.sink.remove_replica(self.info.replica_id)
        except Exception as exc:  # shutting down anyway; the record's TTL cleans up
            log.warning("could not deregister replica %s: %s", self.info.replica_id, exc)

    def _absorb(self, events) -> None:
        mirror, delta, filed = self._mirror, self._delta, self.grid.filed
        for ev in events:
            stored = ev.kind == "stored"
            # Block events are unique (a pool registers or evicts a hash once): a count suffices.
            self._num_cached += len(ev.block_hashes) if stored else -len(ev.block_hashes)
            for h, p in zip(ev.block_hashes, ev.positions, strict=True):
                if not filed(p):
                    continue
                if stored:
                    mirror.add(h)
                    delta.stored.add(h)
                    delta.removed.discard(h)
                else:
                    mirror.discard(h)
                    delta.removed.add(h)
                    delta.stored.discard(h)
        self._num_cached = max(0, self._num_cached)

    def _load_changed(self, load: ReplicaLoad) -> bool:
        last = self._last_load
        return (last is None or load.requests != last.requests or load.healthy != last.healthy
                or load.cached_blocks != last.cached_blocks or abs(load.kv_usage - last.kv_usage) >= 0.01)
