"""`pagedserve bench chaos`: faults under load on a local cluster of real processes (`pagedserve up`'s).

Scenarios, each on the same running cluster: an engine killed with -9 while streams run on it, Redis
stopped for a while under steady load, clients that drop their streams after the first token, a
scheduler SIGTERMed (drained) with streams in flight, and a burst several times what the cluster can
hold. For each: requests sent, completed, failed with a clear error, hung, 5xx, 429s, KV blocks still
held once the load is over (must be 0) and the cluster's RSS before and after. `tests/reliability` runs
the same scenarios with smaller figures; this command prints the table for the README.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx

from services.bench.fleet.load_client import Tally, send
from services.commands.bench_flags import one_of
from services.commands.up import LocalCluster
from services.contracts import metric_names as M
from services.contracts.internal_auth import HEADER


@dataclass
class ChaosConfig:
    model: str | None = None
    dtype: str = "bfloat16"
    replicas: int = 2
    num_kv_blocks: int | None = 2048
    max_num_seqs: int = 64
    max_queue: int = 256  # the router's queue in front of saturated replicas (its default)
    streams: int = 16  # streams in flight when an engine is killed (half of them when a scheduler drains)
    stream_tokens: int = 48
    redis_outage: float = 20.0
    outage_clients: int = 4
    dropped: int = 200
    burst: int = 600
    hang_timeout: float = 120.0
    settle: float = 10.0  # KV blocks must all be back this long after a scenario's load ends
    max_model_len: int | None = 1024


@dataclass
class ScenarioResult:
    name: str
    counts: dict
    blocks_held_after: int
    rss_mb_before: float
    rss_mb_after: float
    recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)
    index_fallbacks: int | None = None  # router decisions that went on load only (the index unread)


class ChaosCluster:
    """A LocalCluster plus what the scenarios do to it; children that die are restarted, as `up` does."""

    def __init__(self, cfg: ChaosConfig, port: int):
        args = SimpleNamespace(host="127.0.0.1", port=port, model=cfg.model, served_model_name=None, dtype=cfg.dtype,
                               device="cpu", block_size=None, num_kv_blocks=cfg.num_kv_blocks, kv_cache_memory=None,
                               max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=None, enable_prefix_caching=None,
                               max_model_len=cfg.max_model_len, max_waiting=None, max_body_bytes=None,
                               max_queue=cfg.max_queue, log_level="warning", policy="prefix", api_keys_file=None,
                               api_keys=None, redis_url=None, cache_isolation=None)
        self.cluster = LocalCluster(args, cfg.replicas, routers=1)
        self._stop = threading.Event()
        self._redis_down = False

    def __enter__(self) -> ChaosCluster:
        self.cluster.start()
        self.url = self.cluster.router_urls[0]
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        threading.Thread(target=self._keep_alive, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.cluster.stop()

    def _keep_alive(self) -> None:
        while not self._stop.wait(0.5):
            self.cluster.restart_dead()

    # -- observing ---------------------------------------------------------------------------------
    def scheduler_health(self, i: int) -> dict | None:
        try:
            r = httpx.get(self.cluster.scheduler_urls[i] + "/health", timeout=2)
            return r.json() if r.status_code in (200, 503) else None
        except (httpx.HTTPError, ValueError):
            return None

    def router_counters(self) -> dict[str, float]:
        """The router's counters (every label summed) from its /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
        return {k: out.get(k, 0.0) for k in (M.ROUTER_ROUTING_DECISIONS, M.ROUTER_INDEX_FALLBACKS)}

    def blocks_in_use(self) -> int:
        healths = (self.scheduler_health(i) or {} for i in range(self.cluster.num_replicas))
        return sum(h.get("kv_blocks_in_use", 0) for h in healths)

    def rss_mb(self) -> float:
        total = 0
        for child in self.cluster._all():
            if child.alive:
                try:
                    for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                except OSError:
                    pass
        return total / 1024

    def wait_replica_healthy(self, i: int, timeout: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            h = self.scheduler_health(i)
            if h and h.get("healthy") and "kv_blocks_in_use" in h:
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    def wait_settled(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            held = self.blocks_in_use()
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.25)

    # -- faults ------------------------------------------------------------------------------------
    def kill_engine(self, i: int) -> None:
        self.cluster.engines[i].proc.send_signal(signal.SIGKILL)

    def sigterm_scheduler(self, i: int) -> None:
        self.cluster.schedulers[i].proc.send_signal(signal.SIGTERM)

    def stop_redis(self) -> None:
        self.cluster.redis.signal(signal.SIGTERM)
        self.cluster.redis.wait(10)

    def start_redis(self) -> None:
        self.cluster.redis.start()  # the same port and password: clients reconnect by themselves

    def body(self, i: int, stream: bool, max_tokens: int) -> dict:
        # Distinct prompts: requests spread over the replicas instead of following one cached prefix.
        return {"model": self.model, "prompt": f"Request {i}: tell me about lighthouse number {i * 7919 % 1000}.",
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


async def _gather(coros) -> Tally:
    tally = Tally()
    for o in await asyncio.gather(*coros):
        tally.add(o)
    return tally


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))


def _result(c: ChaosCluster, cfg: ChaosConfig, name: str, tally: Tally, rss_before: float, **kw) -> ScenarioResult:
    held = c.wait_settled(cfg.settle)
    return ScenarioResult(name, tally.counts(), held, rss_before, c.rss_mb(), **kw)


async def engine_kill(c: ChaosCluster, cfg: ChaosConfig) -> ScenarioResult:
    rss = c.rss_mb()
    async with _client() as client:
        tasks = [asyncio.create_task(send(client, c.url + "/v1/completions", c.body(i, True, cfg.stream_tokens * 4),
                                          cfg.hang_timeout)) for i in range(cfg.streams)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ((c.scheduler_health(0) or {}).get("requests", 0) > 0):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # tokens are flowing
        killed_at = time.monotonic()
        c.kill_engine(0)
        tally = await _gather(tasks)
    recovery = await asyncio.to_thread(c.wait_replica_healthy, 0, 120)
    since_kill = None if recovery is None else time.monotonic() - killed_at
    on_killed = sum(1 for o in tally.outcomes if o.replica == "replica-0")
    return _result(c, cfg, "engine killed (-9)", tally, rss, recovery_s=since_kill,
                   notes=[f"{on_killed} streams were on the killed replica"])


async def redis_outage(c: ChaosCluster, cfg: ChaosConfig) -> ScenarioResult:
    rss = c.rss_mb()
    tally = Tally()
    end = time.monotonic() + cfg.redis_outage + 6

    async def client_loop(k: int, client: httpx.AsyncClient) -> None:
        i = 0
        while time.monotonic() < end:
            tally.add(await send(client, c.url + "/v1/completions", c.body(1000 * k + i, False, 8), cfg.hang_timeout))
            i += 1

    async with _client() as client:
        loops = [asyncio.create_task(client_loop(k, client)) for k in range(cfg.outage_clients)]
        await asyncio.sleep(2)
        # On this (the main) thread: a child dies with the thread that started it (PR_SET_PDEATHSIG), and
        # worker threads end with the scenario.
        c.stop_redis()
        await asyncio.sleep(cfg.redis_outage)
        c.start_redis()
        await asyncio.gather(*loops)
    return _result(c, cfg, f"Redis stopped {cfg.redis_outage:g} s", tally, rss)


async def dropped_streams(c: ChaosCluster, cfg: ChaosConfig) -> ScenarioResult:
    rss = c.rss_mb()
    async with _client() as client:
        tally = await _gather(send(client, c.url + "/v1/completions", c.body(i, True, cfg.stream_tokens * 4),
                                   cfg.hang_timeout, drop_after_first=True) for i in range(cfg.dropped))
    return _result(c, cfg, f"{cfg.dropped} clients drop after the first token", tally, rss)


async def drain(c: ChaosCluster, cfg: ChaosConfig) -> ScenarioResult:
    """Streams straight to one scheduler (as its router would send them), which is then SIGTERMed."""
    rss = c.rss_mb()
    url = c.cluster.scheduler_urls[0] + "/v1/completions"
    headers = {HEADER: c.cluster.token.value}
    n = max(1, cfg.streams // 2)
    async with _client() as client:
        tasks = [asyncio.create_task(send(client, url, c.body(i, True, cfg.stream_tokens), cfg.hang_timeout, headers))
                 for i in range(n)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (c.scheduler_health(0) or {}).get("requests", 0) < n:
            await asyncio.sleep(0.05)
        c.sigterm_scheduler(0)
        tally = await _gather(tasks)
    recovery = await asyncio.to_thread(c.wait_replica_healthy, 0, 120)
    return _result(c, cfg, "scheduler SIGTERMed (drain)", tally, rss, recovery_s=recovery)


async def overload(c: ChaosCluster, cfg: ChaosConfig) -> ScenarioResult:
    rss = c.rss_mb()
    before = c.router_counters()
    async with _client() as client:
        tally = await _gather(send(client, c.url + "/v1/completions", c.body(i, False, 16), cfg.hang_timeout)
                              for i in range(cfg.burst))
    after = c.router_counters()
    decisions, fallbacks = (after[k] - before[k] for k in (M.ROUTER_ROUTING_DECISIONS, M.ROUTER_INDEX_FALLBACKS))
    # Whether the burst was routed on the prefix index: a read that could not be made (no connection free
    # in the router's Redis pool, Redis unreachable) sends its decision on load only.
    return _result(c, cfg, f"{cfg.burst} requests at once", tally, rss, notes=[
        f"router: {decisions:.0f} routing decisions, {fallbacks:.0f} index reads not made (routed on load only)"],
        index_fallbacks=int(fallbacks))


SCENARIOS = {"engine-kill": engine_kill, "redis-outage": redis_outage, "dropped-streams": dropped_streams,
             "drain": drain, "overload": overload}


def check_flags(args) -> None:
    """What `bench chaos` refuses while its command line is parsed (services.commands.flag_rules)."""
    if args.scenarios:
        one_of(args, "scenarios", tuple(SCENARIOS))


def run_scenarios(cfg: ChaosConfig, port: int, names: list[str] | None = None, progress=print) -> list[ScenarioResult]:
    results = []
    with ChaosCluster(cfg, port) as c:
        for name in names or list(SCENARIOS):
            progress(f"chaos: {name} ...")
            result = asyncio.run(SCENARIOS[name](c, cfg))
            progress(f"chaos: {name}: {result.counts}, {result.blocks_held_after} blocks held after")
            results.append(result)
            # The next scenario starts on a whole cluster.
            for i in range(cfg.replicas):
                c.wait_replica_healthy(i, 120)
    return results


def print_table(results: list[ScenarioResult]) -> None:
    head = ("scenario", "sent", "completed", "clear error", "hung", "5xx", "429 (Retry-After)", "blocks held",
            "RSS MB before/after", "recovery")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        k = r.counts
        rec = f"{r.recovery_s:.1f} s" if r.recovery_s is not None else "-"
        print(f"| {r.name} | {k.get('sent', 0)} | {k.get('completed', 0)} | {k.get('clear_error', 0)} | "
              f"{k.get('hung', 0)} | {k.get('5xx', 0)} | {k.get('429', 0)} ({k.get('429_with_retry_after', 0)}) | "
              f"{r.blocks_held_after} | {r.rss_mb_before:.0f}/{r.rss_mb_after:.0f} | {rec} |")


def run(args) -> int:
    from services.commands.ports import free_port

    cfg = ChaosConfig(model=args.model, dtype=args.dtype, replicas=args.replicas, redis_outage=args.redis_outage,
                      dropped=args.dropped, burst=args.burst, streams=args.streams)
    results = run_scenarios(cfg, free_port(), args.scenarios.split(",") if args.scenarios else None)
    print_table(results)
    for r in results:
        for note in r.notes:
            print(f"{r.name}: {note}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
