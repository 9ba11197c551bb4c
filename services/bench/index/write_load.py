"""`bench index --write-rate R`: the fleet's index writes while the router decides, from processes of their
own, at R block events per second per replica.

Each writer process takes a share of the fleet's replicas and, every 20 ms tick, grows each replica's long
sequences by R x 20 ms / 2 blocks (stored at the next positions of a chain) and evicts as many of its
oldest (its LRU tail), exactly as a replica's engine reports them; of those events only the positions the
index files become writes (RedisSink's own commands, services.registry.redis_sink.block_commands: ZADD
and ZREM under the replica's live generation, so they land in the keys routers read, as a real replica's
do). Events that are not filed cost the writer nothing (it counts them and moves the chain on), so one
Python process can stand for many replicas. A writer that falls behind runs flat out; the rate it
achieved (events and writes per second of wall time) is reported beside the target.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

from services.registry.index_grid import IndexGrid
from services.registry.redis_sink import block_commands

TICK = 0.02
FILED_HELD = 50  # filed blocks a replica's cache holds of its growing chains (400 blocks at stride 8)


def _send(client, commands: list[tuple[str, ...]]) -> None:
    pipe = client.pipeline(transaction=False)
    for c in commands:
        pipe.execute_command(*c)
    pipe.execute()


@dataclass
class WriteStats:
    target_events_per_s: float
    events_per_s: float  # block events the writers stood for, per second of wall time
    writes_per_s: float  # index commands sent (ZADD + ZREM), per second
    zadd_calls: int  # the writers' ZADDs (to tell them from the decisions' claims in Redis's accounting)
    seconds: float


class FleetWriter:
    """Writer processes for `generations` (replica id -> its live generation); start(), then stop() ->
    WriteStats."""

    def __init__(self, url: str, namespace: str, generations: dict[str, int], events_per_s: float, grid: IndexGrid,
                 processes: int = 1, seed: int = 0):
        self.spec = dict(url=url, ns=namespace, rate=events_per_s, grid=[grid.dense, grid.stride], seed=seed)
        ids = sorted(generations)
        self.shares = [{rid: generations[rid] for rid in ids[i::processes]} for i in range(processes)]
        self.target = events_per_s * len(ids)
        self._procs: list[subprocess.Popen] = []

    def start(self) -> FleetWriter:
        for i, share in enumerate(self.shares):
            spec = json.dumps({**self.spec, "generations": share, "seed": self.spec["seed"] + i})
            self._procs.append(subprocess.Popen([sys.executable, "-m", "services.bench.index.write_load"],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            self._procs[-1].stdin.write(spec + "\n")
            self._procs[-1].stdin.flush()
        for p in self._procs:  # each says when its first tick is written: the load is on
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("an index writer failed to start")
        return self

    def stop(self) -> WriteStats:
        totals = [0.0, 0.0, 0.0, 0.0]
        for p in self._procs:
            p.stdin.write("stop\n")
            p.stdin.flush()
        for p in self._procs:
            out = json.loads(p.stdout.readline())
            p.wait(30)
            for k, key in enumerate(("events", "writes", "zadds", "seconds")):
                totals[k] = max(totals[k], out[key]) if key == "seconds" else totals[k] + out[key]
        events, writes, zadds, seconds = totals
        return WriteStats(self.target, events / max(seconds, 1e-9), writes / max(seconds, 1e-9), int(zadds), seconds)


def _sync_client(redis_url: str):
    """A blocking client to one node or a cluster, as services.registry.redis_connect.connect decides."""
    from urllib.parse import urlsplit

    import redis
    from redis.cluster import ClusterNode, RedisCluster

    from services.registry.redis_connect import is_cluster, split_cluster_hint, startup_nodes

    url, hint = split_cluster_hint(redis_url)
    if hint if hint is not None else is_cluster(url):
        parts = urlsplit(url)
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in startup_nodes(url)],
                            username=parts.username, password=parts.password)
    return redis.Redis.from_url(url)


def _writer(spec: dict) -> None:
    import select

    client = _sync_client(spec["url"])
    grid, ns, rng = IndexGrid(*spec["grid"]), spec["ns"], random.Random(spec["seed"])
    gens = {rid: int(g) for rid, g in spec["generations"].items()}
    per_tick = spec["rate"] * TICK / 2  # blocks stored per replica per tick (as many evicted)
    position = {rid: 1000 for rid in gens}  # the chains grow far past the dense head
    owed = {rid: 0.0 for rid in gens}
    filed: dict[str, deque[int]] = {rid: deque() for rid in gens}
    # Each replica's cache is full from the start (FILED_HELD filed blocks of its chain), so from the first
    # tick on every block stored evicts one: the steady state of a busy replica.
    for rid, gen in gens.items():
        filed[rid].extend(rng.getrandbits(63) for _ in range(FILED_HELD))
        _send(client, block_commands(ns, gen, list(filed[rid]), ()))
    print("ready", flush=True)
    events = writes = zadds = ticks = 0
    started = time.perf_counter()
    while not (select.select([sys.stdin], [], [], 0)[0] and sys.stdin.readline().strip() == "stop"):
        commands = []
        for rid, gen in gens.items():
            owed[rid] += per_tick
            k = int(owed[rid])
            owed[rid] -= k
            p0 = position[rid]
            position[rid] += k
            stored = [rng.getrandbits(63) for p in range(p0, p0 + k) if grid.filed(p)]
            queue = filed[rid]
            queue.extend(stored)
            removed = [queue.popleft() for _ in range(len(queue) - FILED_HELD)]  # the LRU tail, as fast
            events += 2 * k
            commands += block_commands(ns, gen, stored, removed)
            zadds += len(stored)
        _send(client, commands)
        writes += len(commands)
        ticks += 1
        lag = ticks * TICK - (time.perf_counter() - started)
        if lag > 0:
            time.sleep(lag)
    seconds = time.perf_counter() - started
    print(json.dumps({"events": events, "writes": writes, "zadds": zadds, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    _writer(json.loads(sys.stdin.readline()))
