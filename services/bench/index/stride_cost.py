"""`bench index --stride-decisions D`: what filing one block in STRIDE costs routing, on a workload built to
expose it, against an index that files every block.

The index tells a router the deepest *filed* position of a prompt each replica holds, so two replicas
holding one chain to depths that differ by less than STRIDE look alike (services.registry.index_grid).
The benchmark's own shared-prefix workload hides that: its prefixes end on filed positions and each group
lives on one replica. This one does not. Shared documents of DOC_BLOCKS blocks (a long system prompt, a
file every user of an app quotes) are read by multi-turn sessions to a depth of their own (a session
quotes the document up to where its question is), then each session goes on in short turns (an answer of
1-3 blocks, a question of 1-2), so several replicas hold one document to different depths and a
session's own chain grows a block or two at a time. Sessions run interleaved, with about two requests
in flight per replica (the load the policy weighs against the prefix).

Per grid the same seeded sequence of turns is routed by the real RedisIndex and PrefixPolicy in the
router's own process, each turn cached on the replica chosen (prompt and answer). Measured: the blocks
served from cache, against the best any replica held at that moment (an oracle that knows every cache
exactly), and the decisions that chose less than the best. The stride's cost is the exact index's
cached blocks minus the stride's, over the exact index's.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from services.bench.index.fleet_sim import BLOCK, SEED, FakeReplica, header_tokens, publish_all
from services.bench.index.redis_stats import command_stats, is_cluster
from services.bench.index.router_process import RouterProcess
from services.contracts.block_hash import hash_blocks
from services.registry.index_grid import IndexGrid
from services.registry.model import ReplicaInfo
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, connect

DOC_BLOCKS = 64
TURNS = 6


@dataclass
class StrideResult:
    grid: str
    replicas: int
    decisions: int
    cached_blocks: int  # served from the chosen replica's cache
    best_blocks: int  # the most any replica held of each prompt at its decision, summed
    prompt_blocks: int
    short_decisions: int  # decisions whose replica held fewer blocks than the best one did
    index_writes: int = 0  # ZADD + ZREM the index took over the run (the fleet's publishes and the claims)

    @property
    def of_best(self) -> float:
        return self.cached_blocks / max(1, self.best_blocks)


def _tokens(rng: random.Random, blocks_lo: int, blocks_hi: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(rng.randint(blocks_lo * BLOCK, blocks_hi * BLOCK))]


def session_turns(n: int, decisions: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt block hashes, prompt and answer block hashes) per decision, in arrival order: 3 x n sessions in flight at
    once, each on one of max(2, n // 2) documents quoted to a depth of its own, TURNS short turns each."""
    rng = random.Random(seed)
    head = header_tokens(rng)
    docs = [[rng.randrange(50_000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(max(2, n // 2))]

    def new_session() -> dict:
        doc = rng.choice(docs)
        depth = rng.randint(DOC_BLOCKS // 4, DOC_BLOCKS) * BLOCK
        return {"tokens": head + doc[:depth] + _tokens(rng, 1, 2), "turns": 0}

    active = [new_session() for _ in range(3 * n)]
    out = []
    while len(out) < decisions:
        s = rng.choice(active)
        answer = _tokens(rng, 1, 3)
        prompt = s["tokens"]
        chain = hash_blocks(prompt + answer, BLOCK, SEED)
        out.append((chain[:len(prompt) // BLOCK], chain))
        s["tokens"] = prompt + answer + _tokens(rng, 1, 2)  # the next turn: the history and a new question
        s["turns"] += 1
        if s["turns"] == TURNS:
            active[active.index(s)] = new_session()
    return out


async def run_stride(url: str, n: int, decisions: int, grid: IndexGrid, label: str, seed: int,
                     capacity: int) -> StrideResult:
    client = connect(url, timeout=10)
    await (client.flushall(target_nodes="primaries") if is_cluster(client) else client.flushall())
    sink = RedisSink(client)
    fakes = [FakeReplica(capacity) for _ in range(n)]
    infos = [ReplicaInfo(f"replica-{i}", f"http://replica-{i}", "m", BLOCK, 8192, 8, SEED) for i in range(n)]
    pubs = [ReplicaPublisher(sink, info, f, heartbeat_interval=3600, grid=grid)
            for info, f in zip(infos, fakes, strict=True)]
    await publish_all(pubs)
    writes0 = await _writes(client)
    router = RouterProcess(url, infos[0].identity, BLOCK, grid)
    cached = best = prompt_blocks = short = 0
    window: deque[tuple[int, int]] = deque()
    touched: set[int] = set()
    turns = session_turns(n, decisions, seed)
    try:
        for k, (hashes, served) in enumerate(turns):
            held = [f.cached_prefix(hashes) for f in fakes]
            rid, _ = router.decide(hashes)
            i = int(rid.rsplit("-", 1)[1])
            cached += held[i]
            best += max(held)
            short += held[i] < max(held)
            prompt_blocks += len(hashes)
            fakes[i].admit(served)  # the prompt's blocks and the answer's, cached as the request ends
            fakes[i].inflight += 1
            touched.add(i)
            window.append((k + 2 * n, i))
            while window and window[0][0] <= k:
                r = window.popleft()[1]
                router.finished(f"replica-{r}")
                fakes[r].inflight -= 1
                touched.add(r)
            if k % 10 == 9:  # the publishers' 20 ms batches, as bench index's own loop
                await publish_all([pubs[j] for j in sorted(touched)])
                touched.clear()
        await publish_all([pubs[j] for j in sorted(touched)])
        writes = await _writes(client) - writes0
    finally:
        router.close()
        await client.aclose()
    return StrideResult(label, n, len(turns), cached, best, prompt_blocks, short, writes)


async def _writes(client) -> int:
    stats = await command_stats(client)
    return sum(stats.get(k, (0, 0.0))[0] for k in ("zadd", "zrem"))


def parse_grids(text: str) -> list[IndexGrid]:
    """'8:8,32:8' -> the grids dense 8 stride 8, dense 32 stride 8."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        dense, _, stride = item.partition(":")
        out.append(IndexGrid(int(dense), int(stride or 1)))
    return out


def print_stride(results: list[StrideResult]) -> None:
    """Each grid's line, then each grid's cost against the exact index (the last result)."""
    for r in results:
        print(f"  stride cost, {r.replicas} replicas, {r.grid}: {r.cached_blocks:,} of {r.prompt_blocks:,} prompt "
              f"blocks from cache, {r.of_best:.1%} of the best any replica held; {r.short_decisions} of "
              f"{r.decisions} decisions chose a replica holding less than the best; {r.index_writes:,} index "
              f"writes", flush=True)
    e = results[-1]
    for s in results[:-1]:
        print(f"  {s.grid} at {s.replicas} replicas against the exact index: "
              f"{1 - s.cached_blocks / max(1, e.cached_blocks):.2%} fewer cached blocks; blocks computed (not "
              f"cached) {s.prompt_blocks - s.cached_blocks:,} against {e.prompt_blocks - e.cached_blocks:,} "
              f"({(s.prompt_blocks - s.cached_blocks) / max(1, e.prompt_blocks - e.cached_blocks):.3f}x); index "
              f"writes {s.index_writes / max(1, e.index_writes):.2f}x the exact index's", flush=True)
