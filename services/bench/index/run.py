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
import time
from collections import deque
from dataclasses import asdict
from urllib.parse import urlsplit

from services.bench.host_cpu import describe_cpu
from services.bench.index.fleet_sim import (
    BLOCK,
    H200_EVENTS_PER_S,
    SEED,
    FakeReplica,
    header_tokens,
    oracle_blocks,
    publish_all,
    workload,
)
from services.bench.index.redis_stats import command_stats, is_cluster, minus, node_usec, plus, redis_stats
from services.bench.index.replay import run_replay
from services.bench.index.report import FleetResult, median_result, plot, print_result
from services.bench.index.router_process import RouterProcess
from services.bench.index.stride_cost import parse_grids, print_stride, run_stride
from services.bench.index.write_load import FleetWriter
from services.commands.bench_flags import parsed, positive_numbers
from services.contracts.block_hash import hash_blocks
from services.registry.index_grid import EXACT, GRID
from services.registry.model import ReplicaInfo
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, connect

ADAPTER = ("sql", "a" * 64)  # (name, digest) of the adapter LoRA decisions ask for


async def run_fleet(url: str, n: int, args, replay: bool = True) -> FleetResult:
    rng = random.Random(args.seed)
    client = connect(url, timeout=10)  # the machine is shared: a slow moment is not an outage here
    await (client.flushall(target_nodes="primaries") if is_cluster(client) else client.flushall())
    sink = RedisSink(client)
    fakes = [FakeReplica(args.capacity) for _ in range(n)]
    # One replica in ten holds a LoRA adapter (LoRA decisions rank the whole fleet by residency and load).
    infos = [ReplicaInfo(f"replica-{i}", f"http://replica-{i}", "m", BLOCK, 8192, 8, SEED,
                         adapters={ADAPTER[0]: ADAPTER[1]} if i % 10 == 0 else {}) for i in range(n)]
    identity = infos[0].identity
    pubs = [ReplicaPublisher(sink, info, f, heartbeat_interval=3600) for info, f in zip(infos, fakes, strict=True)]
    _, mem0 = await redis_stats(client)
    head = header_tokens(rng)
    for f in fakes:  # background cache content: chains nobody asks for, and the header (a warm fleet)
        f.admit([rng.getrandbits(63) for _ in range(args.cached_blocks)])
        f.admit(hash_blocks(head, BLOCK, SEED))
    await publish_all(pubs)
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
    writer = None
    if args.write_rate > 0:  # the fleet's own writes, from processes of their own, while the router decides
        gens = {info.replica_id: sink.generation_of(info.replica_id) for info in infos}
        writer = FleetWriter(url, sink.ns, gens, args.write_rate, GRID, args.writers, args.seed).start()
    phase_started, usec_started = time.perf_counter(), (await redis_stats(client))[0]
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
                spent = plus(spent, minus(await command_stats(client), mark))
                # Whoever stored blocks or whose load moved: a real publisher ticks every 20 ms and publishes a
                # load change, so a replica a request just left must not look busy until its next event.
                await publish_all([pubs[j] for j in sorted(touched)])
                touched.clear()
                mark = await command_stats(client)
        spent = plus(spent, minus(await command_stats(client), mark))
        phase_s = time.perf_counter() - phase_started
        redis_busy = ((await redis_stats(client))[0] - usec_started) / 1e6 / phase_s
        writes = writer.stop() if writer is not None else None
        writer = None
        # Session and LoRA decisions: the paths that rank the whole fleet (RouterService._pick), timed alike.
        for k in range(args.special_decisions):  # each request ends before the next: load stays as it was
            hashes = prompts[k % len(prompts)]
            router.finished(router.decide(hashes, session=f"session-{k % 97}")[0])
            router.finished(router.decide(hashes, adapter=ADAPTER)[0])
        totals = router.totals()
    finally:
        if writer is not None:
            writer.stop()
        router.close()
    decisions = len(prompts)
    redis_usec = decision_usec(spent, totals.claim_writes)

    target, absorbed, usec_per_event = await _event_rate(client, pubs, fakes, rng, args)
    replayed = None
    if replay and args.replay_seconds > 0:
        replayed = await run_replay(client, FakeReplica, n, H200_EVENTS_PER_S, args.replay_seconds, sink.ns, rng,
                                    node_usec, urlsplit(url).password)
    await client.aclose()
    lat, cpu = sorted(totals.latencies_s), totals.cpu_s
    redis_us = redis_usec / decisions
    special = {kind: {"p50_ms": percentile(v, 0.5) * 1e3, "p99_ms": percentile(v, 0.99) * 1e3, "decisions": len(v)}
               for kind, v in totals.by_kind.items() if v}
    return FleetResult(
        replicas=n, decisions=decisions, decision_p50_ms=percentile(lat, 0.5) * 1e3,
        decision_p99_ms=percentile(lat, 0.99) * 1e3, redis_us_per_decision=redis_us,
        router_us_per_decision=cpu / decisions * 1e6,
        decisions_per_s_per_redis_core=1e6 / redis_us if redis_us else float("inf"),
        oracle_fraction=cached / max(1, oracle_blocks(prompts, hash_blocks(head, BLOCK, SEED))),
        busiest_vs_fair=max(per_replica) / (decisions / n),
        redis_bytes_per_cached_block=(mem1 - mem0) / max(1, entries), events_per_s_target=target,
        events_per_s_absorbed=absorbed, redis_us_per_event=usec_per_event,
        replay=asdict(replayed) if replayed else None,
        redis_by_command={k: {"calls_per_decision": round(c / decisions, 2), "us_per_decision": round(u / decisions, 2)}
                          for k, (c, u) in sorted(spent.items(), key=lambda kv: -kv[1][1]) if c},
        write_load=asdict(writes) if writes else None, redis_busy_fraction=redis_busy, whole_fleet_decisions=special)


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


def decision_usec(spent: dict[str, tuple[int, float]], claim_writes: int) -> float:
    """Redis usec of the decisions in `spent` (command stats over the decision windows): their reads (ZCOUNT,
    ZRANGEBYSCORE) and their claims' share of the ZADDs, at the mean ZADD's cost; a fleet writing meanwhile
    (ZADD, ZREM) is left out."""
    reads = sum(u for k, (_, u) in spent.items() if k in ("zcount", "zrangebyscore"))
    zadds, zadd_usec = spent.get("zadd", (0, 0.0))
    return reads + (zadd_usec / zadds * min(claim_writes, zadds) if zadds else 0.0)


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
        await publish_all(pubs)
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
        stride = []
        for n in [int(x) for x in str(args.stride_replicas).split(",") if x.strip()] if args.stride_decisions else ():
            grids = [(g, f"dense {g.dense}, stride {g.stride}" + (" (the system's)" if g == GRID else ""))
                     for g in parse_grids(args.stride_grids)] + [(EXACT, "exact")]
            runs = [asyncio.run(run_stride(url, n, args.stride_decisions, grid, label, args.seed, args.capacity))
                    for grid, label in grids]
            print_stride(runs)
            stride += runs
    finally:
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.signal(15)
            server.wait(10)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"machine": describe_cpu(), "fleet": [asdict(r) for r in results],
                       "stride_cost": [{**asdict(r), "of_best": r.of_best} for r in stride]}, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0
