"""`pagedserve bench index`: the prefix index under a simulated fleet, on real Redis (one node or a cluster).

Per fleet size N: N fake replicas (an LRU prefix cache each, pre-filled with `--cached-blocks` blocks)
publish real block events through the scheduler's own ReplicaPublisher and RedisSink; a router, in a process
of its own (index_router), decides through the real RedisIndex and PrefixPolicy on a seeded shared-prefix
workload (a header every prompt
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
from urllib.parse import urlsplit

from services.bench.index.replay import run_replay
from services.bench.index.report import FleetResult, median_result, plot, print_result
from services.bench.index.router_process import RouterProcess
from services.commands.bench_flags import parsed, positive_numbers
from services.contracts.block_hash import hash_blocks
from services.registry.model import ReplicaInfo, ReplicaLoad
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, connect

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


async def redis_stats(client) -> tuple[float, int]:
    """(command usec, used_memory bytes) summed over every node (one, or every cluster primary); the
    INFO calls this benchmark makes are left out."""
    usec = sum(u for _, u in (await command_stats(client)).values())
    if _is_cluster(client):
        from redis.asyncio.cluster import RedisCluster

        mem = list((await client.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
    else:
        mem = [await client.info("memory")]
    return usec, sum(int(m.get("used_memory", 0)) for m in mem)


async def _node_commandstats(client) -> dict[str, dict]:
    if _is_cluster(client):
        from redis.asyncio.cluster import RedisCluster

        return await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    return {"one": await client.info("commandstats")}


async def node_usec(client) -> dict[str, float]:
    """Node -> command usec so far (INFO left out)."""
    return {name: sum(float(v.get("usec", 0)) for k, v in node.items()
                      if k.startswith("cmdstat_") and k != "cmdstat_info")
            for name, node in (await _node_commandstats(client)).items()}


async def command_stats(client) -> dict[str, tuple[int, float]]:
    """Command name -> (calls, usec) summed over every node, INFO left out."""
    out: dict[str, tuple[int, float]] = {}
    for node in (await _node_commandstats(client)).values():
        for k, v in node.items():
            if k.startswith("cmdstat_") and k != "cmdstat_info":
                calls, usec = out.get(k[8:], (0, 0.0))
                out[k[8:]] = (calls + int(v.get("calls", 0)), usec + float(v.get("usec", 0)))
    return out


def _plus(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    return {k: (a.get(k, (0, 0.0))[0] + b.get(k, (0, 0.0))[0], a.get(k, (0, 0.0))[1] + b.get(k, (0, 0.0))[1])
            for k in a.keys() | b.keys()}


def _minus(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    return {k: (c - b.get(k, (0, 0.0))[0], u - b.get(k, (0, 0.0))[1]) for k, (c, u) in a.items()}


def _is_cluster(client) -> bool:
    return type(client).__name__ == "RedisCluster"


async def run_fleet(url: str, n: int, args, replay: bool = True) -> FleetResult:
    rng = random.Random(args.seed)
    client = connect(url, timeout=10)  # the machine is shared: a slow moment is not an outage here
    await (client.flushall(target_nodes="primaries") if _is_cluster(client) else client.flushall())
    sink = RedisSink(client)
    fakes = [FakeReplica(args.capacity) for _ in range(n)]
    infos = [ReplicaInfo(f"replica-{i}", f"http://replica-{i}", "m", BLOCK, 8192, 8, SEED) for i in range(n)]
    identity = infos[0].identity
    pubs = [ReplicaPublisher(sink, info, f, heartbeat_interval=3600) for info, f in zip(infos, fakes, strict=True)]
    _, mem0 = await redis_stats(client)
    head = header_tokens(rng)
    for f in fakes:  # background cache content: chains nobody asks for, and the header (a warm fleet)
        f.admit([rng.getrandbits(63) for _ in range(args.cached_blocks)])
        f.admit(hash_blocks(head, BLOCK, SEED))
    await _publish_all(pubs)
    _, mem1 = await redis_stats(client)
    entries = sum(len(f.cache) for f in fakes)

    router = RouterProcess(url, identity, BLOCK)
    # Rounds of fresh groups until --min-decisions: at 10 replicas one round is 100 decisions, too few for a
    # p99. Each round is shuffled on its own, so what a round shares stays within it (plus the header).
    groups = max(1, n * args.groups_per_replica)
    prompts = []
    while True:
        prompts += workload(groups, args.questions, rng, head)
        if len(prompts) >= args.min_decisions:
            break
    cached = 0
    spent: dict[str, tuple[int, float]] = {}  # Redis commands of the decisions (publishes left out)
    per_replica = [0] * n
    window: deque[tuple[int, int]] = deque()  # requests in flight: (decision that ends it, replica)
    hold = args.hold or 2 * n  # about two requests in flight per replica
    touched: set[int] = set()  # replicas whose cache or load changed since the last publish
    try:
        mark = await command_stats(client)
        for k, hashes in enumerate(prompts):
            rid, _ = router.decide(hashes)  # as RouterService._pick: the prompt's holders and the least loaded
            i = int(rid.rsplit("-", 1)[1])
            cached += fakes[i].cached_prefix(hashes)
            fakes[i].admit(hashes)
            per_replica[i] += 1
            fakes[i].inflight += 1
            touched.add(i)
            window.append((k + hold, i))
            while window and window[0][0] <= k:
                r = window.popleft()[1]
                router.finished(f"replica-{r}")
                fakes[r].inflight -= 1
                touched.add(r)
            if k % args.publish_every == args.publish_every - 1:  # the publishers' 20 ms batches
                spent = _plus(spent, _minus(await command_stats(client), mark))
                # Whoever stored blocks or whose load moved: a real publisher ticks every 20 ms and publishes a
                # load change, so a replica a request just left must not look busy until its next event.
                await _publish_all([pubs[j] for j in sorted(touched)])
                touched.clear()
                mark = await command_stats(client)
        totals = router.totals()
    finally:
        router.close()
    spent = _plus(spent, _minus(await command_stats(client), mark))
    redis_usec = sum(u for _, u in spent.values())
    decisions = len(prompts)

    target, absorbed, usec_per_event = await _event_rate(client, pubs, fakes, rng, args)
    replayed = None
    if replay and args.replay_seconds > 0:
        replayed = await run_replay(client, FakeReplica, n, H200_EVENTS_PER_S, args.replay_seconds, sink.ns, rng,
                                    node_usec, urlsplit(url).password)
    await client.aclose()
    lat, cpu = sorted(totals.latencies_s), totals.cpu_s
    redis_us = redis_usec / decisions
    return FleetResult(
        replicas=n, decisions=decisions, decision_p50_ms=statistics.median(lat) * 1e3,
        decision_p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, redis_us_per_decision=redis_us,
        router_us_per_decision=cpu / decisions * 1e6,
        decisions_per_s_per_redis_core=1e6 / redis_us if redis_us else float("inf"),
        oracle_fraction=cached / max(1, oracle_blocks(prompts, hash_blocks(head, BLOCK, SEED))),
        busiest_vs_fair=max(per_replica) / (decisions / n),
        redis_bytes_per_cached_block=(mem1 - mem0) / max(1, entries), events_per_s_target=target,
        events_per_s_absorbed=absorbed, redis_us_per_event=usec_per_event,
        replay=asdict(replayed) if replayed else None,
        redis_by_command={k: {"calls_per_decision": round(c / decisions, 2), "us_per_decision": round(u / decisions, 2)}
                          for k, (c, u) in sorted(spent.items(), key=lambda kv: -kv[1][1]) if c})


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
        for f in fakes:  # each replica's long sequences grow: their blocks continue a chain
            f.admit([rng.getrandbits(63) for _ in range(per_tick)], f.stream_position)
            f.stream_position += per_tick
        events += n * per_tick * 2
        await _publish_all(pubs)
        lag = (time.perf_counter() - t0) - events / target
        if lag < 0:
            await asyncio.sleep(-lag)
    wall = time.perf_counter() - t0
    usec1, _ = await redis_stats(client)
    return target, events / wall, (usec1 - usec0) / max(1, events)


def fleet_sizes(text: str) -> list[int]:
    """--replicas: comma-separated fleet sizes, each >= 1."""
    return positive_numbers(str(text), int)


def check_flags(args) -> None:
    """What `bench index` refuses while its command line is parsed (services.commands.flag_rules)."""
    parsed(args, "replicas", fleet_sizes)


def run(args) -> int:
    from services.commands.ports import free_port
    from services.commands.processes import Child
    from services.commands.redis_binary import find_redis_server, missing_message
    from services.commands.redis_cluster import LocalRedisCluster, _wait_port

    sizes = fleet_sizes(args.replicas)
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
    runs: dict[int, list[FleetResult]] = {n: [] for n in sizes}
    try:
        for p in range(args.passes):  # alternating order: a drift of the machine hits every size alike
            if args.passes > 1:
                print(f"  pass {p + 1} of {args.passes}", flush=True)
            for n in (sizes if p % 2 == 0 else sizes[::-1]):
                r = asyncio.run(run_fleet(url, n, args, replay=p == 0))
                runs[n].append(r)
                print_result(r)
        results = [median_result(runs[n]) for n in sizes]
        if args.passes > 1:
            print(f"  medians of {args.passes} passes:", flush=True)
            for r in results:
                print_result(r)
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
        plot(results, args.plot)
    return 0
