"""`pagedserve up` with two models of two replicas each and a LoRA adapter resident on one replica only:
requests route by `model`, every request for the adapter lands where it is resident, and with that
replica stopped, the other replica of its model loads it from the shared --lora-dir and serves it.
Unknown adapter names are 404s naming them; no model name through the router is ever a 5xx."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis

from services.commands.ports import free_port
from services.registry import keys
from tests.proc_children import cmdline, descendant_pids

pytest.importorskip("services.scheduler.async_scheduler")

KEY = "admin-key-of-this-test"


def _info(redis_url: str, replica_id: str) -> dict:
    """A replica's registry record as Redis holds it (the signed JSON): its identity part."""
    raw = redis.Redis.from_url(redis_url).get(keys.replica_key(keys.DEFAULT_NAMESPACE, replica_id))
    return json.loads(raw)["info"] if raw else {}


def _adapters(redis_url: str, replica_id: str) -> dict:
    return _info(redis_url, replica_id).get("adapters", {})


def _scheduler_pid(up_pid: int, replica_id: str) -> int:
    for pid in descendant_pids(up_pid):
        argv = cmdline(pid) or []
        if b"scheduler" in argv and replica_id.encode() in argv:
            return pid
    raise AssertionError(f"no scheduler process of {replica_id}")


def _complete(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={"model": model, "prompt": prompt, "max_tokens": 2})


def test_up_routes_an_adapter_to_its_one_resident_replica_or_loads_it_once(tiny_llama_dir, tmp_path, redis_server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.engine.lora_adapters import save_random_adapter

    save_random_adapter(tiny_llama_dir, tmp_path / "adapters" / "sql", seed=1)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--model", f"alpha={tiny_llama_dir}",
                             "--model", f"beta={tiny_llama_dir}", "--replicas", "2", "--port", str(port),
                             "--host", "127.0.0.1", "--redis-url", redis_server.url, "--dtype", "float32",
                             "--device", "cpu", "--num-kv-blocks", "64", "--max-loras", "1",
                             "--lora-dir", str(tmp_path / "adapters"), "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PAGEDSERVE_LORA_ADMIN_KEY": KEY})
    try:
        banner = proc.stdout.readline()
        assert "pagedserve up: 4 replicas (alpha x2, beta x2)" in banner, banner
        lines = [proc.stdout.readline() for _ in range(5)]
        schedulers = {x.split()[0]: x.split()[-1] for x in lines if x.strip().startswith(("alpha-", "beta-"))}
        url = f"http://127.0.0.1:{port}"

        # Loaded at run time on ONE replica of alpha, through that replica's admin endpoint.
        loaded = httpx.post(schedulers["alpha-0"] + "/v1/load_lora_adapter", timeout=60,
                            headers={"Authorization": f"Bearer {KEY}"}, json={"lora_name": "sql", "lora_path": "sql"})
        assert loaded.status_code == 200, loaded.text
        digest = loaded.json()["digest"]
        deadline = time.monotonic() + 30
        while "sql" not in {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}:
            assert time.monotonic() < deadline, "the router never learned the adapter from the registry"
            time.sleep(0.2)

        landed, resident_s = [], []
        for i in range(20):
            started = time.monotonic()
            r = _complete(url, "sql", f"select row {i} from the table " * 3)
            resident_s.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
            landed.append(r.headers["x-pagedserve-replica"])
        assert set(landed) == {"alpha-0"}, landed
        assert _adapters(redis_server.url, "alpha-1") == {}, "never loaded where it was not needed"
        for model in ("alpha", "beta"):
            for i in range(3):
                r = _complete(url, model, f"base request {i} " * 3)
                assert r.status_code == 200 and r.headers["x-pagedserve-replica"] in (f"{model}-0", f"{model}-1")

        missing = _complete(url, "nosuch-adapter", "x")
        assert missing.status_code == 404 and "nosuch-adapter" in missing.json()["error"]["message"]

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.text(max_size=40))
        def never_5xx(name):
            resp = _complete(url, name, "x")
            assert resp.status_code < 500, (name, resp.text)

        never_5xx()

        # The resident replica stops: every request still succeeds, served by alpha's other replica, which
        # loads the adapter from the shared directory (once: after that it is resident there).
        os.kill(_scheduler_pid(proc.pid, "alpha-0"), signal.SIGKILL)
        after, after_s = [], []
        for i in range(8):
            started = time.monotonic()
            r = _complete(url, "sql", f"after the stop {i} " * 3)
            after_s.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
            after.append(r.headers["x-pagedserve-replica"])
        assert after[0] == "alpha-1", after
        assert _adapters(redis_server.url, "alpha-1") == {"sql": digest}
        loads = {rid: _info(redis_server.url, rid).get("adapter_load_seconds") for rid in ("alpha-0", "alpha-1")}
        print(f"\nlora-routing: admin load on alpha-0 {loads['alpha-0']}s, on-demand load on alpha-1 "
              f"{loads['alpha-1']}s; request on the resident replica median {sorted(resident_s)[10]:.3f}s, "
              f"first after the stop (connection refused, retry, load) {after_s[0]:.3f}s, "
              f"then median {sorted(after_s[1:])[3]:.3f}s", flush=True)
        time.sleep(2)  # alpha-0 is back (up restarts it) without the adapter; alpha-1 holds it now
        again = {_complete(url, "sql", f"settled {i} " * 3).headers["x-pagedserve-replica"] for i in range(6)}
        assert again == {"alpha-1"}, again
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
