"""`bench index --replay-seconds S`: whether the index absorbs a whole fleet's block writes at the H200 rate.

The fleet simulation of index_bench cannot itself produce 1,000 replicas' events in real time here: its
fake caches and publishers cost microseconds of Python per event, and a real fleet runs one publisher per
replica. So the writes are produced first, untimed, by the real ReplicaPublisher and RedisSink (its
commands recorded instead of sent) for S seconds of fleet time at the H200 rate, each replica's cache
full and its long sequences growing; then they are sent pre-encoded over one raw connection per shard
primary, every shard at once. The index keeps up if every write is applied in at most S seconds of wall
time. Redis CPU per write comes from INFO commandstats around the replay.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from redis.crc import key_slot

from services.registry.model import ReplicaInfo, ReplicaState
from services.registry.publisher import ReplicaPublisher
from services.registry.redis_sink import RedisSink, block_commands

TICK = 0.02  # a publisher's batch interval (ReplicaPublisher.event_interval)


@dataclass
class ReplayResult:
    seconds_of_fleet_time: float
    block_events: int  # what the replicas' engines stored and evicted
    index_writes: int  # what reached the index (the filed positions)
    wall_s: float
    writes_per_s: float
    target_writes_per_s: float
    redis_us_per_write: float
    busiest_shard_cpu_fraction: float  # that shard's Redis CPU over the replay's wall time


class _RecordingSink(RedisSink):
    """RedisSink's generations and commands, appended to a list instead of sent."""

    def __init__(self, namespace: str):
        super().__init__(client=None, namespace=namespace)
        self.commands: list[tuple[str, ...]] = []

    async def write_state(self, state: ReplicaState, ttl: float) -> None:
        pass  # records are a separate, small stream: what is measured here is the block writes

    async def _file(self, gen: int, stored, removed) -> None:
        self.commands += block_commands(self.ns, gen, stored, removed)


async def record(fake_cls, n: int, events_per_s: float, seconds: float, namespace: str,
                 rng: random.Random) -> tuple[list[tuple[str, ...]], int]:
    """(the index writes of n replicas over `seconds`, the block events behind them)."""
    per_tick = max(1, round(events_per_s * TICK / 2))  # blocks stored per replica per tick, as many evicted
    capacity = 25 * per_tick
    sink = _RecordingSink(namespace)
    fakes = [fake_cls(capacity) for _ in range(n)]
    pubs = [ReplicaPublisher(sink, ReplicaInfo(f"replay-{i}", f"http://replay-{i}", "m", 16, 8192, 8, 0), f,
                             heartbeat_interval=3600) for i, f in enumerate(fakes)]
    for f in fakes:  # a full cache: from the first recorded tick on, each block stored evicts one
        f.admit([rng.getrandbits(63) for _ in range(capacity)], 0)
        f.stream_position = capacity
    for p in pubs:
        await p.tick()  # the full first publish, not part of the steady stream
    sink.commands.clear()
    events = 0
    for t in range(round(seconds / TICK)):
        for f in fakes:
            f.admit([rng.getrandbits(63) for _ in range(per_tick)], f.stream_position)
            f.stream_position += per_tick
        for p in pubs:
            await p.tick()
        events += 2 * per_tick * n
        if t % 10 == 9:
            print(f"    recording the fleet's writes: {(t + 1) * TICK:.1f} of {seconds:.1f} s", end="\r", flush=True)
    print(flush=True)
    return sink.commands, events


def encode(args: tuple[str, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def by_node(client, commands: list[tuple[str, ...]]) -> dict[tuple[str, int], list[bytes]]:
    """(host, port) of the primary each command's key lives on -> its encoded commands, in order."""
    if type(client).__name__ != "RedisCluster":
        kw = client.connection_pool.connection_kwargs
        return {(kw.get("host", "127.0.0.1"), int(kw.get("port", 6379))): [encode(c) for c in commands]}
    out: dict[tuple[str, int], list[bytes]] = {}
    nodes = client.nodes_manager
    for c in commands:
        node = nodes.get_node_from_slot(key_slot(c[1].encode()))
        out.setdefault((node.host, int(node.port)), []).append(encode(c))
    return out


async def _send(host: str, port: int, blob: bytes, replies: int, password: str | None) -> bytes:
    """Write the whole pipeline, reading its replies meanwhile; the replies (one line each)."""
    reader, writer = await asyncio.open_connection(host, port)
    if password:
        writer.write(encode(("AUTH", password)))
        line = await reader.readline()
        if not line.startswith(b"+OK"):
            raise ConnectionError(f"{host}:{port} refused AUTH: {line[:100]!r}")
    got, chunks = 0, []

    async def read() -> None:
        nonlocal got
        while got < replies:
            chunk = await reader.read(1 << 20)
            if not chunk:
                raise ConnectionError(f"{host}:{port} closed after {got} of {replies} replies")
            chunks.append(chunk)
            got += chunk.count(b"\r\n")  # ZADD and ZREM answer one integer line (or one error line)

    task = asyncio.create_task(read())
    writer.write(blob)
    await writer.drain()
    await task
    writer.close()
    return b"".join(chunks)


async def replay(client, commands: list[tuple[str, ...]], stats, password: str | None) -> tuple[float, float, float]:
    """(wall seconds, Redis usec in all, busiest primary's usec), every node's share sent at once."""
    if type(client).__name__ == "RedisCluster":
        await client.initialize()
    plan = by_node(client, commands)
    before = await stats(client)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(_send(h, p, b"".join(cmds), len(cmds), password) for (h, p), cmds in plan.items()))
    wall = time.perf_counter() - t0
    after = await stats(client)
    for out in outs:
        at = (b"\r\n" + out).find(b"\r\n-")  # a line that is an error, not an integer
        if at >= 0:
            raise RuntimeError(f"the index refused a write: {out[at:at + 200]!r}")
    per_node = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return wall, sum(per_node.values()), max(per_node.values(), default=0.0)


async def run_replay(client, fake_cls, n: int, events_per_s: float, seconds: float, namespace: str,
                     rng: random.Random, stats, password: str | None = None) -> ReplayResult:
    """`stats(client)` -> {node: command usec so far}."""
    commands, events = await record(fake_cls, n, events_per_s, seconds, namespace, rng)
    wall, usec, busiest = await replay(client, commands, stats, password)
    return ReplayResult(
        seconds_of_fleet_time=seconds, block_events=events, index_writes=len(commands), wall_s=wall,
        writes_per_s=len(commands) / wall, target_writes_per_s=len(commands) / seconds,
        redis_us_per_write=usec / max(1, len(commands)), busiest_shard_cpu_fraction=busiest / 1e6 / wall)
