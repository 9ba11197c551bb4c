"""`pagedserve up`: a local cluster of real processes: redis-server (or, with --redis-cluster N, a Redis
Cluster of N shards), engine+scheduler replicas of one or several models, routers.

With several models (`--model NAME=PATH[:REPLICAS]` repeated, services.commands.model_specs) every
replica registers its model in the one registry and the routers serve them all, learning each model's
tokenizer from there (they are given no model).

Every service runs as its own `pagedserve` process with the flags of services.commands.settings, exactly as in
Kubernetes, so this is the multi-process deployment on one machine. A replica process that dies is
restarted (and rejoins through the registry); Ctrl-C stops routers first, then replicas, then Redis.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time

import httpx

from services.commands import settings as S
from services.commands.model_specs import parse_model_specs
from services.commands.ports import free_port
from services.commands.processes import ENGINE_FLAGS, Child, flags
from services.commands.redis_binary import find_redis_server, missing_message
from services.commands.redis_cluster import LocalRedisCluster
from services.contracts.internal_auth import InternalToken
from services.registry.redis_sink import redacted

log = logging.getLogger(__name__)

STOP_TIMEOUT = 15.0
READY_TIMEOUT = 600.0


class LocalCluster:
    def __init__(self, args, replicas: int, routers: int = 1, python: str = sys.executable):
        """`replicas`: per model (a model's own count in NAME=PATH:REPLICAS wins)."""
        self.args = args
        self.models = parse_model_specs(getattr(args, "model", None), replicas,
                                        getattr(args, "served_model_name", None))
        self.cli = [python, "-m", "services.commands.cli"]
        self.redis: Child | None = None
        self.redis_cluster: LocalRedisCluster | None = None
        self.redis_url = getattr(args, "redis_url", None)
        self.token = InternalToken.generate()  # routers and schedulers of this cluster share it
        self.engines: list[Child] = []
        self.schedulers: list[Child] = []
        self.routers: list[Child] = []
        self.scheduler_urls: list[str] = []
        self.replica_ids: list[str] = []
        self.router_urls: list[str] = []
        self.num_replicas = sum(m.replicas for m in self.models)
        self.num_routers = routers
        self.stop_requested = False  # set from a signal handler; start-up gives up waiting

    # -- building the process table ---------------------------------------------------------------
    def _plan(self) -> None:
        a = self.args
        if not self.redis_url and getattr(a, "redis_cluster", 0):
            # A real Redis Cluster of N shards (+1 replica each): the registry as it runs at fleet scale.
            self.redis_cluster = LocalRedisCluster(a.redis_cluster)
            self.redis_url = self.redis_cluster.url
        if not self.redis_url:
            exe = find_redis_server()
            if exe is None:
                raise SystemExit(f"pagedserve up: {missing_message()}")
            port = free_port()
            password = secrets.token_urlsafe(24)
            # The password goes in through stdin ("-" reads config from it), not argv, which /proc shows.
            self.redis = Child("redis", [exe, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--loglevel", "warning"], quiet=True,
                               stdin=f"requirepass {password}\n")
            self.redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
        # Secrets reach children through their environment, never their command line.
        secret_env = {**self.token.env(), "PAGEDSERVE_REDIS_URL": self.redis_url}
        if getattr(a, "api_keys", None):
            secret_env["PAGEDSERVE_API_KEYS"] = a.api_keys
        if getattr(a, "lora_admin_key", None):  # every replica's run-time adapter endpoints take it
            secret_env[S.LORA_ADMIN_KEY.env] = a.lora_admin_key
        threads = str(max(1, (os.cpu_count() or 1) // self.num_replicas))
        engine_flags = flags(a, [n for n in ENGINE_FLAGS if n != "model"])
        sched_flags = flags(a, ["max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "max_model_len",
                                "max_waiting", "max_body_bytes", "lora_modules", "lora_dir", "speculative_config",
                                "log_level"])
        several = len(self.models) > 1  # never with --lora-modules (flag_rules.several_models)
        for spec in self.models:
            model = ["--model", spec.path] if spec.path else []
            named = ["--served-model-name", spec.name] if spec.name else []
            for k in range(spec.replicas):
                i = len(self.engines)
                rid = f"{spec.name}-{k}" if several else f"replica-{i}"
                ep, sp = free_port(), free_port()
                # Replicas share the machine's cores: one torch thread pool each, sized to its share.
                env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": threads}
                self.engines.append(Child(f"engine-{rid}", [*self.cli, "engine", "--host", "127.0.0.1", "--port",
                                                            str(ep), *model, *engine_flags],
                                          {**env, **self.token.env()}))
                url = f"http://127.0.0.1:{sp}"
                self.schedulers.append(Child(f"scheduler-{rid}", [
                    *self.cli, "scheduler", "--host", "127.0.0.1", "--port", str(sp), "--engine",
                    f"tcp://127.0.0.1:{ep}", "--replica-id", rid, "--advertise-url", url, "--heartbeat-interval",
                    "0.5", *model, *named, *sched_flags],
                    {k: v for k, v in secret_env.items() if k != "PAGEDSERVE_API_KEYS"}))
                self.scheduler_urls.append(url)
                self.replica_ids.append(rid)
        for j in range(self.num_routers):
            port = a.port + j
            # No model: routers learn every model's tokenizer from the registry.
            router_flags = flags(a, ["policy", "cache_isolation", "api_keys_file", "max_queue", "max_body_bytes",
                                     "log_level"])
            self.routers.append(Child(f"router-{j}", [*self.cli, "router", "--host", a.host, "--port", str(port),
                                                      *router_flags], dict(secret_env)))
            self.router_urls.append(f"http://127.0.0.1:{port}")

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT) -> None:
        self._plan()
        if self.redis:
            self.redis.start()
        if self.redis_cluster:
            self.redis_cluster.start()
        for child in self.engines + self.schedulers + self.routers:
            child.start()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for url in self.router_urls:
            while True:
                if self.stop_requested:
                    raise InterruptedError("stopped during start-up")
                self._check_alive()
                try:
                    body = httpx.get(url + "/health", timeout=2).json()
                    if len(body.get("replicas", [])) >= self.num_replicas:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster not ready after {timeout:.0f}s")
                time.sleep(0.3)

    def _check_alive(self) -> None:
        for child in self._all():
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} during start-up")

    def _all(self) -> list[Child]:
        return ([self.redis] if self.redis else []) + self.engines + self.schedulers + self.routers

    def restart_dead(self) -> None:
        """Restart replica processes that died (engines rejoin through their scheduler's supervision)."""
        for child in self.engines + self.schedulers:
            if child.proc is not None and child.proc.poll() is not None:
                log.warning("%s exited with code %s; restarting it", child.name, child.proc.returncode)
                child.restarts += 1
                child.start()

    def stop(self) -> None:
        for group in (self.routers, self.schedulers, self.engines, [self.redis] if self.redis else []):
            for child in group:
                child.signal(signal.SIGTERM)
            for child in group:
                child.wait(STOP_TIMEOUT)
        if self.redis_cluster:
            self.redis_cluster.stop()


def run(args) -> int:
    try:
        cluster = LocalCluster(args, args.replicas, args.routers)
    except ValueError as exc:
        raise SystemExit(f"pagedserve up: {exc}") from None

    def request_stop(*_) -> None:
        cluster.stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        cluster.start()
        models = ", ".join(f"{m.name or 'model'} x{m.replicas}" for m in cluster.models)
        print(f"pagedserve up: {cluster.num_replicas} replicas ({models}), registry {redacted(cluster.redis_url)}",
              flush=True)
        for url in cluster.router_urls:
            print(f"  router      {url}/v1", flush=True)
        for rid, url in zip(cluster.replica_ids, cluster.scheduler_urls, strict=True):
            print(f"  {rid:<11} {url}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while not cluster.stop_requested:
            cluster.restart_dead()
            time.sleep(0.5)
    except InterruptedError:
        pass
    except (TimeoutError, RuntimeError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        print("pagedserve up: stopping", flush=True)
        cluster.stop()
    return 0
