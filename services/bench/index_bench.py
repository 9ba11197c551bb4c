"""`pagedserve bench index`: the prefix index under a simulated fleet, on real Redis (one node or a cluster).

Per fleet size N: N fake replicas (an LRU prefix cache each, pre-filled with `--cached-blocks` blocks)
publish real block events through the scheduler's own ReplicaPublisher and RedisSink; a router decides
through the real RedisIndex and PrefixPolicy on a seeded shared-prefix workload (a header every prompt
shares, one system prompt per group, a unique question), and each request lands in the chosen replica's
cache, which publishes what it stored and evicted. Measured: decision latency (index read + ranking),
Redis CPU per decision (INFO commandstats over the decision windows), router CPU per decision, Redis memory
per cached block, routing quality against a perfect router (cached tokens vs the oracle's, busiest replica
vs its fair share), and the block events per second the index absorbs.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from services.block_hash import hash_blocks
from services.registry.model import ReplicaInfo, ReplicaLoad
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, connect
from services.router.metrics import RouterMetrics
from services.router.policies import PrefixPolicy, RouteRequest, useful_blocks
from services.router.redis_index import RedisIndex
from services.router.replicas import ReplicaView

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


class FakeReplica:
    """What the publisher reads from a replica: its load and the KV events of its LRU prefix cache."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.events: list[Event] = []
        self.inflight = 0

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

    def admit(self, hashes: list[int]) -> None:
        """The request ran here: its blocks are cached (prefix last touched), the LRU tail evicted."""
        new = [h for h in hashes if h not in self.cache]
        for h in reversed(hashes):  # the prefix ends up most recently used: evicted last
            self.cache[h] = None
            self.cache.move_to_end(h)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        if new:
            self.events.append(Event("stored", new))
        if evicted:
            self.events.append(Event("removed", evicted))


def workload(groups: int, questions: int, rng: random.Random, header: int = 4, system: int = 60,
             question: int = 64) -> list[list[int]]:
    """Block-hash chains of groups x questions prompts, shuffled: header + system prompt + question blocks."""
    head = [rng.randrange(50_000) for _ in range(header * BLOCK)]
    prompts = []
    for _ in range(groups):
        sys_ids = [rng.randrange(50_000) for _ in range(system * BLOCK)]
        for _ in range(questions):
            ids = head + sys_ids + [rng.randrange(50_000) for _ in range(question * BLOCK)]
            prompts.append(hash_blocks(ids, BLOCK, SEED))
    rng.shuffle(prompts)
    return prompts


def oracle_blocks(prompts: list[list[int]]) -> int:
    """Blocks a perfect router (every earlier prompt's cache reachable) serves from cache."""
    seen: set[int] = set()
    total = 0
    for hashes in prompts:
        for h in hashes:
            if h not in seen:
                break
            total += 1
        seen.update(hashes)
    return total


async def redis_stats(client) -> tuple[float, int]:
    """(command usec, used_memory bytes) summed over every node (one, or every cluster primary); the
    INFO calls this benchmark makes are left out."""
    if _is_cluster(client):
        from redis.asyncio.cluster import RedisCluster

        nodes = list((await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)).values())
        mem = list((await client.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
    else:
        nodes, mem = [await client.info("commandstats")], [await client.info("memory")]
    usec = sum(v.get("usec", 0) for node in nodes for k, v in node.items()
               if k.startswith("cmdstat_") and k != "cmdstat_info")
    return usec, sum(int(m.get("used_memory", 0)) for m in mem)


def _is_cluster(client) -> bool:
    return type(client).__name__ == "RedisCluster"


@dataclass
class FleetResult:
    replicas: int
    decisions: int
    decision_p50_ms: float
    decision_p99_ms: float
    redis_us_per_decision: float
    router_us_per_decision: float
    decisions_per_s_per_redis_core: float
    oracle_fraction: float
    busiest_vs_fair: float
    redis_bytes_per_cached_block: float
    events_per_s_target: float
    events_per_s_absorbed: float
    redis_us_per_event: float


async def run_fleet(url: str, n: int, args) -> FleetResult:
    rng = random.Random(args.seed)
    client = connect(url, timeout=10)  # the machine is shared: a slow moment is not an outage here
    await (client.flushall(target_nodes="primaries") if _is_cluster(client) else client.flushall())
    sink = RedisSink(client)
    fakes = [FakeReplica(args.capacity) for _ in range(n)]
    pubs = [ReplicaPublisher(sink, ReplicaInfo(f"replica-{i}", f"http://replica-{i}", "m", BLOCK, 8192, 8, SEED),
                             f, heartbeat_interval=3600) for i, f in enumerate(fakes)]
    _, mem0 = await redis_stats(client)
    for f in fakes:  # background cache content: chains nobody asks for
        f.admit([rng.getrandbits(63) for _ in range(args.cached_blocks)])
    await _publish_all(pubs)
    _, mem1 = await redis_stats(client)
    entries = sum(len(f.cache) for f in fakes)

    index = RedisIndex(client)
    view = ReplicaView(index, RouterMetrics())
    policy = PrefixPolicy()
    prompts = workload(max(1, n * args.groups_per_replica), args.questions, rng)
    lat, cpu, cached, redis_usec, publish_usec = [], 0.0, 0, 0.0, 0.0
    per_replica = [0] * n
    window: deque[tuple[int, int]] = deque()  # requests in flight: (decision that ends it, replica)
    hold = args.hold or 2 * n  # about two requests in flight per replica
    await view.snapshot([])
    usec_start, _ = await redis_stats(client)
    for k, hashes in enumerate(prompts):
        t0, c0 = time.perf_counter(), time.process_time()
        route = RouteRequest(hashes, len(hashes) * BLOCK, BLOCK)
        live = await view.snapshot(hashes, useful_blocks(route))  # as the router's decision does
        ranked = policy.rank(live, route)
        lat.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        chosen = ranked[0]
        i = int(chosen.info.replica_id.rsplit("-", 1)[1])
        await view.claim(chosen.info.replica_id, hashes, chosen.matched_blocks)
        cached += fakes[i].cached_prefix(hashes)
        fakes[i].admit(hashes)
        per_replica[i] += 1
        view.inflight[chosen.info.replica_id] += 1
        fakes[i].inflight += 1
        window.append((k + hold, i))
        while window and window[0][0] <= k:
            r = window.popleft()[1]
            view.inflight[f"replica-{r}"] -= 1
            fakes[r].inflight -= 1
        if k % args.publish_every == args.publish_every - 1:  # the publishers' 20 ms batches
            before, _ = await redis_stats(client)
            await _publish_all([pubs[j] for j in range(n) if fakes[j].events])
            after, _ = await redis_stats(client)
            publish_usec += after - before
    usec_end, _ = await redis_stats(client)
    redis_usec = usec_end - usec_start - publish_usec
    decisions = len(prompts)

    target, absorbed, usec_per_event = await _event_rate(client, pubs, fakes, rng, args)
    await index.close()
    await client.aclose()
    lat.sort()
    redis_us = redis_usec / decisions
    return FleetResult(
        replicas=n, decisions=decisions, decision_p50_ms=statistics.median(lat) * 1e3,
        decision_p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, redis_us_per_decision=redis_us,
        router_us_per_decision=cpu / decisions * 1e6,
        decisions_per_s_per_redis_core=1e6 / redis_us if redis_us else float("inf"),
        oracle_fraction=cached / max(1, oracle_blocks(prompts)), busiest_vs_fair=max(per_replica) / (decisions / n),
        redis_bytes_per_cached_block=(mem1 - mem0) / max(1, entries), events_per_s_target=target,
        events_per_s_absorbed=absorbed, redis_us_per_event=usec_per_event)


async def _publish_all(pubs: list[ReplicaPublisher]) -> None:
    for i in range(0, len(pubs), 64):  # a bounded number of pipelines in flight at once
        await asyncio.gather(*(p.tick() for p in pubs[i:i + 64]))


async def _event_rate(client, pubs, fakes, rng, args) -> tuple[float, float, float]:
    """Churn every replica's cache at the H200 rate (scaled by --event-scale) in 20 ms ticks for a few
    seconds; absorbed = events written / wall time (below target: the index fell behind)."""
    n = len(fakes)
    target = n * H200_EVENTS_PER_S * args.event_scale
    per_tick = max(1, int(target * 0.02 / n / 2))  # blocks stored per replica per tick (as many evicted)
    events, t0 = 0, time.perf_counter()
    usec0, _ = await redis_stats(client)
    while time.perf_counter() - t0 < args.event_seconds:
        for f in fakes:
            f.admit([rng.getrandbits(63) for _ in range(per_tick)])
        events += n * per_tick * 2
        await _publish_all(pubs)
        lag = (time.perf_counter() - t0) - events / target
        if lag < 0:
            await asyncio.sleep(-lag)
    wall = time.perf_counter() - t0
    usec1, _ = await redis_stats(client)
    return target, events / wall, (usec1 - usec0) / max(1, events)


def run(args) -> int:
    from services.commands.processes import Child
    from services.commands.redis_binary import find_redis_server, missing_message
    from services.commands.redis_cluster import LocalRedisCluster, _wait_port
    from services.ports import free_port

    sizes = [int(x) for x in str(args.replicas).split(",") if x.strip()]
    server: Child | None = None
    cluster: LocalRedisCluster | None = None
    if args.redis_cluster:
        cluster = LocalRedisCluster(args.redis_cluster).start()
        url, where = cluster.url, f"a {args.redis_cluster}-shard local Redis Cluster (+1 replica each)"
    else:
        exe = find_redis_server()
        if exe is None:
            raise SystemExit(f"pagedserve bench index: {missing_message()}")
        port = free_port()
        server = Child("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                       quiet=True)
        server.start()
        _wait_port(port, time.monotonic() + 10)
        url, where = f"redis://127.0.0.1:{port}/0", "one local redis-server"
    print(f"index benchmark on {where}; {args.cached_blocks} background blocks per replica, "
          f"{args.groups_per_replica} system prompt(s) per replica x {args.questions} questions, "
          f"128-block prompts (4 shared by all, 60 per group)", flush=True)
    results = []
    try:
        for n in sizes:
            r = asyncio.run(run_fleet(url, n, args))
            results.append(r)
            print(f"  {n:>5} replicas: decision p50 {r.decision_p50_ms:6.2f} ms p99 {r.decision_p99_ms:6.2f} ms | "
                  f"Redis {r.redis_us_per_decision:6.1f} us/decision (~{r.decisions_per_s_per_redis_core:,.0f}/s per "
                  f"core) | router CPU {r.router_us_per_decision:6.0f} us | oracle {r.oracle_fraction:.1%} | busiest "
                  f"{r.busiest_vs_fair:.2f}x fair | {r.redis_bytes_per_cached_block:.0f} B/block | events "
                  f"{r.events_per_s_absorbed:,.0f}/s of {r.events_per_s_target:,.0f}/s target, "
                  f"{r.redis_us_per_event:.2f} us each", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.signal(15)
            server.wait(10)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _plot(results: list[FleetResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.replicas for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ns, [r.decision_p99_ms * 1e3 for r in results], "o-", label="decision p99 (us)")
    ax.plot(ns, [r.decision_p50_ms * 1e3 for r in results], "o-", label="decision p50 (us)")
    ax.plot(ns, [r.redis_us_per_decision for r in results], "s-", label="Redis CPU per decision (us)")
    ax.plot(ns, [r.router_us_per_decision for r in results], "^-", label="router CPU per decision (us)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("microseconds")
    ax.set_title("prefix index: cost per routing decision against fleet size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
