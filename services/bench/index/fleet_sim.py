"""The simulated fleet of `bench index`: fake replicas (an LRU prefix cache each, publishing real block
events with their chain positions through the scheduler's own ReplicaPublisher and RedisSink), the
workload of shared-prefix prompts, and what a perfect router would have served from cache."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from dataclasses import dataclass

from services.contracts.block_hash import hash_blocks
from services.registry.model import ReplicaLoad
from services.registry.publisher import ReplicaPublisher

BLOCK = 16
SEED = 1234
# The H200 figure every replica's event stream is sized on (docs/architecture.md states the arithmetic):
# Llama-3.1-8B BF16 at batch ~128 computes ~16,000 new KV tokens/s (prefill + decode) = 1,000 blocks of 16
# stored per second, and as many evicted once the cache is full: 2,000 block events/s per replica.
H200_EVENTS_PER_S = 2000


@dataclass
class Event:
    kind: str
    block_hashes: list[int]
    positions: list[int]


class FakeReplica:
    """What the publisher reads from a replica: its load and the KV events of its LRU prefix cache."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.cache: OrderedDict[int, int] = OrderedDict()  # block hash -> its position in its chain
        self.events: list[Event] = []
        self.inflight = 0
        self.stream_position = 0  # where the event-rate phase's chain has got to

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(num_running=self.inflight, cached_blocks=len(self.cache))

    def drain_kv_events(self) -> list:
        out, self.events = self.events, []
        return out

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def admit(self, hashes: list[int], start: int = 0) -> None:
        """The request ran here: its blocks (positions start, start + 1, ... of their chain) are cached,
        prefix last touched, and the LRU tail evicted."""
        new = [(h, start + p) for p, h in enumerate(hashes) if h not in self.cache]
        for p in range(len(hashes) - 1, -1, -1):  # the prefix ends up most recently used: evicted last
            self.cache[hashes[p]] = start + p
            self.cache.move_to_end(hashes[p])
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False))
        if new:
            self.events.append(Event("stored", [h for h, _ in new], [p for _, p in new]))
        if evicted:
            self.events.append(Event("removed", [h for h, _ in evicted], [p for _, p in evicted]))


def header_tokens(rng: random.Random, blocks: int = 4) -> list[int]:
    """The chat-template header every prompt of the fleet starts with."""
    return [rng.randrange(50_000) for _ in range(blocks * BLOCK)]


def workload(groups: int, questions: int, rng: random.Random, head: list[int], system: int = 60,
             question: int = 64) -> list[list[int]]:
    """Block-hash chains of groups x questions prompts, shuffled: header + system prompt + question blocks."""
    prompts = []
    for _ in range(groups):
        sys_ids = [rng.randrange(50_000) for _ in range(system * BLOCK)]
        for _ in range(questions):
            ids = head + sys_ids + [rng.randrange(50_000) for _ in range(question * BLOCK)]
            prompts.append(hash_blocks(ids, BLOCK, SEED))
    rng.shuffle(prompts)
    return prompts


def oracle_blocks(prompts: list[list[int]], warm=()) -> int:
    """Blocks a perfect router (every earlier prompt's cache reachable, and the `warm` blocks every replica
    holds from the start) serves from cache."""
    seen: set[int] = set(warm)
    total = 0
    for hashes in prompts:
        for h in hashes:
            if h not in seen:
                break
            total += 1
        seen.update(hashes)
    return total


async def publish_all(pubs: list[ReplicaPublisher]) -> None:
    for i in range(0, len(pubs), 64):  # a bounded number of pipelines in flight at once
        await asyncio.gather(*(p.tick() for p in pubs[i:i + 64]))
