"""`bench index`'s router, in a process of its own: the real RedisIndex, ReplicaView and PrefixPolicy deciding
for the prompts the fleet simulation sends it over a pipe.

A production router holds the replicas' records and its own in-flight counts, not a fleet's caches: in one
process with the simulation, the router's decisions ran among a heap of millions of simulated cache entries
(at 1,000 replicas), and timed the simulation's memory as much as the index. Here the decision is timed in
the router's process (index reads and ranking, as RouterService._pick does them); between two decisions the
router is idle, so its background record refresh runs while the fleet publishes, as it would in production.

A decision is a base-model prefix decision (the shortlist, as RouterService._pick takes it), or, given a
session id or a LoRA adapter, the path those take there: the whole fleet's snapshot ranked by the session
or prefix policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

from services.registry.index_grid import GRID, IndexGrid
from services.registry.model import ModelIdentity


@dataclass
class RouterTotals:
    """What the router measured over its decisions."""

    latencies_s: list[float]  # per base-model prefix decision: the index read and the ranking
    cpu_s: float  # the router process's CPU over those same spans (its background refresh included)
    claim_writes: int  # ZADDs its claims sent (to tell them from a fleet's writes in Redis's accounting)
    by_kind: dict[str, list[float]]  # "session" and "lora" decisions' latencies (the whole fleet ranked)


class RouterProcess:
    """The router, started in a fresh interpreter (nothing of the simulation's heap comes along; and unlike
    multiprocessing's spawn, the caller's main module is not re-run there)."""

    def __init__(self, url: str, identity: ModelIdentity, block_size: int, grid: IndexGrid = GRID):
        ours, theirs = socket.socketpair()
        spec = json.dumps({"url": url, "identity": asdict(identity), "block_size": block_size,
                           "fd": theirs.fileno(), "grid": [grid.dense, grid.stride]})
        self._proc = subprocess.Popen([sys.executable, "-m", "services.bench.index.router_process", spec],
                                      pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        self._finished: list[str] = []
        try:
            self._call(("ready",))
        except BaseException:  # e.g. Redis unreachable: the router must not outlive the bench
            self.close()
            raise

    def decide(self, hashes: list[int], session: str | None = None, adapter: tuple[str, str] | None = None
               ) -> tuple[str, int]:
        """(the replica chosen for this prompt, the leading blocks it holds or was claimed for); the router
        counts the request in flight there and claims the prompt's blocks for it. `session`: a session id
        (the session policy); `adapter`: (name, digest) of a LoRA adapter the request names."""
        finished, self._finished = self._finished, []
        return self._call(("decide", hashes, finished, session, adapter))

    def finished(self, replica_id: str) -> None:
        """A request the router sent to `replica_id` ended (told to it with the next decision)."""
        self._finished.append(replica_id)

    def totals(self) -> RouterTotals:
        return RouterTotals(*self._call(("totals",)))

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                self._call(("close",))
        finally:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._conn.close()

    def _call(self, msg: tuple):
        self._conn.send(msg)
        deadline = time.monotonic() + 60
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise RuntimeError(f"bench router exited ({self._proc.returncode}) before answering {msg[0]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench router did not answer {msg[0]!r} within 60 s")
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise RuntimeError(f"bench router failed on {msg[0]!r}") from reply
        return reply


def _reader(conn, inbox: asyncio.Queue, loop):
    """The pipe's readable callback. A bench that went away (EOF) closes the router: left registered, an
    EOF pipe would be readable forever and spin the loop."""
    def read() -> None:
        try:
            inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            inbox.put_nowait(("close",))
    return read


def _serve(conn, url: str, identity: ModelIdentity, block_size: int, grid: IndexGrid) -> None:
    asyncio.run(_router(conn, url, identity, block_size, grid))


async def _router(conn, url: str, identity: ModelIdentity, block_size: int, grid: IndexGrid) -> None:
    from services.registry.redis_sink import connect
    from services.router.metrics import RouterMetrics
    from services.router.policies import RANKED, PrefixPolicy, RouteRequest, SessionPolicy, useful_blocks
    from services.router.redis_index import RedisIndex
    from services.router.replicas import ReplicaView, saturated

    client = connect(url, timeout=10)  # the machine is shared: a slow moment is not an outage here
    index = RedisIndex(client, grid=grid)
    view = ReplicaView(index, RouterMetrics())
    policy, sessions = PrefixPolicy(), SessionPolicy()
    inbox: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    # The pipe is read when it is readable, so the refresh loop runs between two messages.
    loop.add_reader(conn.fileno(), _reader(conn, inbox, loop))
    latencies: list[float] = []
    by_kind: dict[str, list[float]] = {"session": [], "lora": []}
    cpu, claims = 0.0, 0
    try:
        while True:
            msg = await inbox.get()
            try:
                if msg[0] == "ready":
                    await view.snapshot([])
                    reply = True
                elif msg[0] == "decide":
                    _, hashes, finished, session, adapter = msg
                    for rid in finished:
                        view.inflight[rid] -= 1
                    route = RouteRequest(hashes, len(hashes) * block_size, block_size, session_id=session,
                                         adapter=adapter[0] if adapter else None,
                                         adapter_digest=adapter[1] if adapter else "")
                    t0, c0 = time.perf_counter(), time.process_time()
                    if session is None and adapter is None:
                        live, _ = await view.shortlist(hashes, useful_blocks(route), identity, RANKED)
                    else:  # RouterService._pick: the whole fleet's snapshot for these
                        live = [r for r in await view.snapshot(hashes, useful_blocks(route))
                                if r.info.identity == identity and not saturated(r)]
                    chosen = (sessions if session else policy).rank(live, route)[0]
                    took = time.perf_counter() - t0
                    if session is None and adapter is None:
                        latencies.append(took)
                        cpu += time.process_time() - c0
                    else:
                        by_kind["session" if session else "lora"].append(took)
                    await view.claim(chosen.info.replica_id, hashes, chosen.matched_blocks)
                    claims += len(grid.filed_positions(chosen.matched_blocks, len(hashes)))
                    view.inflight[chosen.info.replica_id] += 1
                    reply = (chosen.info.replica_id, chosen.matched_blocks)
                elif msg[0] == "totals":
                    reply = (latencies, cpu, claims, by_kind)  # plain types: the child runs as __main__
                else:  # close
                    with contextlib.suppress(OSError):  # the bench may be gone already
                        conn.send(True)
                    return
            except Exception as exc:  # raised on the bench's side (as text: not every exception pickles)
                reply = RuntimeError(f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    finally:
        loop.remove_reader(conn.fileno())
        await index.close()
        await client.aclose()


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    _serve(Connection(_spec["fd"]), _spec["url"], ModelIdentity(**_spec["identity"]), _spec["block_size"],
           IndexGrid(*_spec["grid"]))
