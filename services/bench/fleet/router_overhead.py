"""`bench router-overhead`: what the router costs a request, two ways.

1. Latency: the same chat request sent straight to a scheduler stub (which answers at once) and through
   the router, many times, compared at the median: the difference is the router's path alone.
2. CPU per request (`--cpu`, on by default): a real `pagedserve up` cluster (router, scheduler, engine
   on the bundled model), the router's and the scheduler's process CPU time (user + system, from
   /proc) over N sequential requests of each kind: plain chat with a long system prompt, chat with a
   JSON schema, chat with tools. CPU time, unlike latency, is what a replica's or a router's core
   count is sized by, and host contention barely moves it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx


def _serve_stub(port: int) -> None:
    """A scheduler stand-in that answers at once, so timings measure the path, not a model."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return reply

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _median_latency(url: str, body: dict, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as client:
        deadline = time.monotonic() + 60
        # A router learns replicas from its background refresh of the registry: wait for the first answer.
        while (first := client.post(url, json=body)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        if first.status_code != 200:
            raise RuntimeError(f"{url} answered {first.status_code}: {first.text[:300]}")
        for _ in range(max(20, n // 10)):  # warm-up: connections, caches, JIT-free but lazy imports
            client.post(url, json=body).raise_for_status()
        for _ in range(n):
            t0 = time.perf_counter()
            client.post(url, json=body).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def run_overhead(args) -> int:
    import asyncio

    from services.commands.ports import free_port
    from services.commands.up import Child
    from services.contracts.block_hash import model_hash_seed
    from services.model_files.model_source import DEFAULT_MODEL_NAME, resolve_model
    from services.model_files.tokenizer import ModelTokenizer
    from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
    from services.registry.redis_sink import RedisSink, connect

    redis_port, stub_port, router_port = free_port(), free_port(), free_port()
    redis = Child("redis", [shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--save", "",
                            "--appendonly", "no"], quiet=True)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    router = Child("router", [sys.executable, "-m", "services.commands.cli", "router", "--host", "127.0.0.1", "--port",
                              str(router_port), "--redis-url", redis_url, "--log-level", "warning"])
    stub = multiprocessing.get_context("spawn").Process(target=_serve_stub, args=(stub_port,), daemon=True)
    stub_url = f"http://127.0.0.1:{stub_port}"
    try:
        redis.start()
        stub.start()
        time.sleep(0.5)
        # The stub publishes the bundled model's tokenizer, as a scheduler does: the router routes with it.
        tokenizer = ModelTokenizer(resolve_model(None))
        info = ReplicaInfo("stub", stub_url, DEFAULT_MODEL_NAME, 16, 8192, 256,
                           model_hash_seed(DEFAULT_MODEL_NAME, 16), tokenizer_digest=tokenizer.digest)

        async def register():
            client = connect(redis_url)
            await RedisSink(client).write_tokenizer(tokenizer.digest, tokenizer.bundle)
            await RedisSink(client).write_state(ReplicaState(info, ReplicaLoad()), ttl=3600)
            await client.aclose()

        for _ in range(50):
            try:
                asyncio.run(register())
                break
            except Exception:
                time.sleep(0.1)
        router.start()
        _wait_http(f"http://127.0.0.1:{router_port}/health")
        _wait_http(stub_url + "/docs")
        system = "You are a helpful assistant for a shipping company. " * 30
        body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 16,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]}
        direct = _median_latency(stub_url + "/v1/chat/completions", body, args.requests)
        routed = _median_latency(f"http://127.0.0.1:{router_port}/v1/chat/completions", body, args.requests)
    finally:
        router.signal(15)
        router.wait(10)
        stub.terminate()
        redis.signal(15)
        redis.wait(10)
    d, r = statistics.median(direct), statistics.median(routed)
    p90 = lambda xs: sorted(xs)[int(len(xs) * 0.9)]
    print(f"{args.requests} sequential chat requests (~{len(system) // 4} prompt tokens), loopback, keep-alive:")
    print(f"  straight to the scheduler : median {d * 1e3:6.2f} ms, p90 {p90(direct) * 1e3:6.2f} ms")
    print(f"  through the router        : median {r * 1e3:6.2f} ms, p90 {p90(routed) * 1e3:6.2f} ms")
    print(f"  router overhead           : median {(r - d) * 1e3:6.2f} ms (target < 2 ms): "
          f"{'PASS' if r - d < 0.002 else 'FAIL'}")
    if args.cpu:
        print(f"CPU per request, {args.requests} sequential requests of each kind through `pagedserve up` "
              "(router, scheduler, engine on the bundled model), max_tokens 4:")
        report = cpu_per_request(args.requests, args.model)
        if args.json_path:
            import json

            Path(args.json_path).write_text(json.dumps({"latency_ms": {"direct": d * 1e3, "routed": r * 1e3},
                                                        "cpu_ms_per_request": report}, indent=2))
    return 0


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.1)


# -- CPU per request on a real cluster ---------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")
SYSTEM = "You are a helpful assistant for a shipping company. Answer briefly and politely. " * 30
_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
_TOOLS = [{"type": "function", "function": {"name": "track_parcel", "description": "Where a parcel is",
                                             "parameters": {"type": "object", "properties": {
                                                 "id": {"type": "string"}}, "required": ["id"]}}}]


def request_kinds(model: str) -> dict[str, dict]:
    chat = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]}
    return {"chat": chat,
            "json_schema": {**chat, "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": _SCHEMA}}},
            "tools": {**chat, "tools": _TOOLS}}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def child_pids(pid: int) -> dict[int, str]:
    """Direct children of `pid`: their command lines."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _service_pid(children: dict[int, str], name: str) -> int:
    found = [pid for pid, cmd in children.items() if f"services.commands.cli {name} " in cmd + " "]
    if len(found) != 1:
        raise RuntimeError(f"expected one {name} process under `pagedserve up`, found {found}: {children}")
    return found[0]


def cpu_per_request(requests: int, model: str | None = None) -> dict[str, dict[str, float]]:
    """Milliseconds of router and scheduler CPU per request of each kind, on a fresh `pagedserve up`."""
    from services.commands.ports import free_port
    from services.commands.processes import Child

    port = free_port()
    argv = [sys.executable, "-m", "services.commands.cli", "up", "--replicas", "1", "--port", str(port),
            "--log-level", "warning"]
    if model:
        argv += ["--model", model]
    up = Child("up", argv)
    up.start()
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/v1/models", timeout=1800)
        with httpx.Client(timeout=120) as client:
            deadline = time.monotonic() + 600
            while not (models := client.get(url + "/v1/models").json()["data"]):  # until a replica registers
                if time.monotonic() > deadline:
                    raise TimeoutError("no replica registered with the router of `pagedserve up`")
                time.sleep(0.5)
            served = models[0]["id"]
            while True:  # /v1/models answers before the replica has registered: wait for a served request
                r = client.post(url + "/v1/chat/completions", json=request_kinds(served)["chat"])
                if r.status_code == 200 or time.monotonic() > deadline:
                    r.raise_for_status()
                    break
                time.sleep(0.5)
            children = child_pids(up.proc.pid)
            pids = {"router": _service_pid(children, "router"), "scheduler": _service_pid(children, "scheduler")}
            result = {}
            for kind, body in request_kinds(served).items():
                for _ in range(max(3, requests // 10)):  # warm: compiled grammars, tokenizer caches
                    client.post(url + "/v1/chat/completions", json=body).raise_for_status()
                before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
                for _ in range(requests):
                    client.post(url + "/v1/chat/completions", json=body).raise_for_status()
                result[kind] = {name: round(1000 * (process_cpu_seconds(pid) - before[name]) / requests, 3)
                                for name, pid in pids.items()}
                print(f"  {kind:12s} router {result[kind]['router']:7.2f} ms CPU/request, "
                      f"scheduler {result[kind]['scheduler']:7.2f} ms CPU/request", flush=True)
            return result
    finally:
        up.signal(15)
        up.wait(60)
