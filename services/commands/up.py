"""`pagedserve up`: a local cluster of real processes: redis-server, N engine+scheduler replicas, routers.

Every service runs as its own `pagedserve` process with the flags of services.settings, exactly as in
Kubernetes, so this is the multi-process deployment on one machine. A replica process that dies is
restarted (and rejoins through the registry); Ctrl-C stops routers first, then replicas, then Redis.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from services.ports import free_port

log = logging.getLogger(__name__)

STOP_TIMEOUT = 15.0
READY_TIMEOUT = 600.0


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `up` itself dies without cleaning up (e.g. SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()  # own process group: a terminal's Ctrl-C reaches `up`, which stops children in order


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    quiet: bool = False  # drop its stdout (redis-server's banner)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, preexec_fn=_die_with_parent,
                                     stdout=subprocess.DEVNULL if self.quiet else None)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait()


def _flags(args, names: list[str]) -> list[str]:
    """Pass through the options the user gave (None means: leave the service's default)."""
    out = []
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


class LocalCluster:
    def __init__(self, args, replicas: int, routers: int = 1, python: str = sys.executable):
        self.args = args
        self.cli = [python, "-m", "services.cli"]
        self.redis: Child | None = None
        self.redis_url = getattr(args, "redis_url", None)
        self.engines: list[Child] = []
        self.schedulers: list[Child] = []
        self.routers: list[Child] = []
        self.scheduler_urls: list[str] = []
        self.router_urls: list[str] = []
        self.num_replicas = replicas
        self.num_routers = routers
        self.stop_requested = False  # set from a signal handler; start-up gives up waiting

    # -- building the process table ---------------------------------------------------------------
    def _plan(self) -> None:
        a = self.args
        if not self.redis_url:
            exe = shutil.which("redis-server")
            if exe is None:
                raise SystemExit("redis-server not found: install it (apt-get install -y redis-server) or pass "
                                 "--redis-url")
            port = free_port()
            self.redis = Child("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--loglevel", "warning"], quiet=True)
            self.redis_url = f"redis://127.0.0.1:{port}/0"
        threads = str(max(1, (os.cpu_count() or 1) // self.num_replicas))
        for i in range(self.num_replicas):
            ep, sp = free_port(), free_port()
            engine_flags = _flags(a, ["model", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory",
                                      "max_model_len", "attention_backend", "enforce_eager", "max_num_seqs",
                                      "log_level"])
            # Replicas share the machine's cores: one torch thread pool each, sized to its share.
            env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": threads}
            self.engines.append(Child(f"engine-{i}", [*self.cli, "engine", "--host", "127.0.0.1", "--port", str(ep),
                                                      *engine_flags], env))
            sched_flags = _flags(a, ["model", "served_model_name", "max_num_seqs", "max_num_batched_tokens",
                                     "enable_prefix_caching", "max_model_len", "max_body_bytes", "log_level"])
            url = f"http://127.0.0.1:{sp}"
            self.schedulers.append(Child(f"scheduler-{i}", [
                *self.cli, "scheduler", "--host", "127.0.0.1", "--port", str(sp), "--engine", f"tcp://127.0.0.1:{ep}",
                "--redis-url", self.redis_url, "--replica-id", f"replica-{i}", "--advertise-url", url,
                "--heartbeat-interval", "0.5", *sched_flags]))
            self.scheduler_urls.append(url)
        for j in range(self.num_routers):
            port = a.port + j
            router_flags = _flags(a, ["model", "policy", "api_keys_file",
                                      "api_keys", "max_body_bytes", "log_level"])
            self.routers.append(Child(f"router-{j}", [*self.cli, "router", "--host", a.host, "--port", str(port),
                                                      "--redis-url", self.redis_url, *router_flags]))
            self.router_urls.append(f"http://127.0.0.1:{port}")

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT) -> None:
        self._plan()
        if self.redis:
            self.redis.start()
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


def run(args) -> int:
    cluster = LocalCluster(args, args.replicas, args.routers)

    def request_stop(*_) -> None:
        cluster.stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        cluster.start()
        print(f"pagedserve up: {args.replicas} replicas, registry {cluster.redis_url}", flush=True)
        for url in cluster.router_urls:
            print(f"  router      {url}/v1", flush=True)
        for i, url in enumerate(cluster.scheduler_urls):
            print(f"  replica-{i}   {url}", flush=True)
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
