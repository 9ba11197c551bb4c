"""`pagedserve scheduler` before and after its engine: /health is 503 until the handshake (what the
Kubernetes startup probe waits for), then 200, and the replica registers itself in Redis."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import redis

from services.commands.ports import free_port

pytest.importorskip("services.scheduler.async_scheduler")


def test_scheduler_is_unready_until_its_engine_answers(tiny_llama_dir, redis_server):
    engine_port, port = free_port(), free_port()
    scheduler = subprocess.Popen([
        sys.executable, "-m", "services.commands.cli", "scheduler", "--host", "127.0.0.1", "--port", str(port),
        "--engine", f"tcp://127.0.0.1:{engine_port}", "--model", str(tiny_llama_dir), "--redis-url", redis_server.url,
        "--replica-id", "r0", "--log-level", "warning"])
    engine = None
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                r = httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        body = {"model": "x", "prompt": "hi"}
        assert httpx.post(url + "/v1/completions", json=body, timeout=5).status_code == 503
        engine = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "engine", "--host", "127.0.0.1",
                                   "--port",
                                   str(engine_port), "--model", str(tiny_llama_dir), "--dtype", "float32",
                                   "--num-kv-blocks", "64", "--log-level", "warning"])
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline + 120
            time.sleep(0.2)
        # It registers within a heartbeat of becoming ready.
        while not redis.Redis.from_url(redis_server.url).exists("pagedserve:replica:r0"):
            assert time.monotonic() < deadline + 130, "the ready scheduler never registered"
            time.sleep(0.1)
        scheduler.terminate()
        assert scheduler.wait(30) == 0
        assert not redis.Redis.from_url(redis_server.url).exists("pagedserve:replica:r0")  # left on SIGTERM
    finally:
        for proc in (scheduler, engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
