"""`pagedserve up` from the command line: it starts redis-server, replicas and a router as separate
processes, serves, and Ctrl-C stops every one of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.commands.ports import free_port
from tests.proc_children import cmdline, descendant_pids

# These run the services as real processes: they need the whole engine stack.
pytest.importorskip("services.scheduler.async_scheduler")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _interrupt_and_expect_no_orphans(proc: subprocess.Popen, children: set[int]) -> None:
    """Ctrl-C `up`: it exits 0 and every process it started is gone within 10 s."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a child of pagedserve up outlived it"
        time.sleep(0.1)


def test_up_serves_and_ctrl_c_stops_everything(tiny_llama_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--replicas", "2", "--port",
                             str(port),
                             "--host", "127.0.0.1", "--model", str(tiny_llama_dir), "--dtype", "float32",
                             "--device", "cpu", "--num-kv-blocks", "128", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert "pagedserve up: 2 replicas" in banner, banner
        lines = [proc.stdout.readline() for _ in range(3)]
        children = descendant_pids(proc.pid)
        assert len(children) >= 6  # redis, 2 engines, 2 schedulers, 1 router
        # The internal hops are closed: Redis wants its password, schedulers their router's token, and
        # neither secret is on any command line (/proc/<pid>/cmdline is readable by every local user).
        redis_port = int(banner.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", redis_port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(64).startswith(b"-NOAUTH")
        scheduler_url = next(x.split()[-1] for x in lines if x.strip().startswith("replica-0"))
        direct = httpx.post(scheduler_url + "/v1/completions", timeout=30,
                            json={"model": Path(tiny_llama_dir).name, "prompt": "hello", "max_tokens": 3})
        assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_internal_token"
        for pid in children:
            argv = b"\0".join(cmdline(pid) or [])
            assert b"redis://:" not in argv and b"requirepass" not in argv
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": Path(tiny_llama_dir).name, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-pagedserve-replica"] in ("replica-0", "replica-1")
        _interrupt_and_expect_no_orphans(proc, children)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_with_a_redis_cluster_serves_through_it(tiny_llama_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--replicas", "1",
                             "--redis-cluster", "3",
                             "--port", str(port), "--host", "127.0.0.1", "--model", str(tiny_llama_dir),
                             "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert "pagedserve up: 1 replicas" in banner and "cluster=true" in banner and "***" in banner, banner
        children = descendant_pids(proc.pid)
        assert len(children) >= 9  # 6 redis nodes (3 primaries, 3 replicas), an engine, a scheduler, a router
        body = {"model": Path(tiny_llama_dir).name, "prompt": "hello " * 40, "max_tokens": 3}
        for _ in range(2):  # the second finds the first's blocks through the cluster's index
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json=body)
            assert r.status_code == 200 and r.headers["x-pagedserve-replica"] == "replica-0"
        _interrupt_and_expect_no_orphans(proc, children)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_serves_two_models_with_two_replicas_each_by_name(tiny_llama_dir):
    """Two models (the tiny weights under two names), two replicas each, one router that was given no
    model: requests route by `model`, each model's tokenizer having come from the registry."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--model", f"alpha={tiny_llama_dir}",
                             "--model", f"beta={tiny_llama_dir}", "--replicas", "2", "--port", str(port),
                             "--host", "127.0.0.1", "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert "pagedserve up: 4 replicas (alpha x2, beta x2)" in banner, banner
        children = descendant_pids(proc.pid)
        url = f"http://127.0.0.1:{port}"
        listed = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert sorted(m["id"] for m in listed) == ["alpha", "beta"]
        for model in ("alpha", "beta"):
            seen = set()
            for i in range(4):
                r = httpx.post(url + "/v1/completions", timeout=60,
                               json={"model": model, "prompt": f"request {i} " * 3, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == model
                seen.add(r.headers["x-pagedserve-replica"])
            assert seen <= {f"{model}-0", f"{model}-1"} and seen
        missing = httpx.post(url + "/v1/completions", timeout=10, json={"model": "gamma", "prompt": "x"})
        assert missing.status_code == 404 and "alpha, beta" in missing.json()["error"]["message"]
        _interrupt_and_expect_no_orphans(proc, children)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_serves_a_lora_adapter_on_every_replica_with_its_key_off_the_command_line(tiny_llama_dir, tmp_path):
    from tests.engine.lora_adapters import save_random_adapter

    adapter = save_random_adapter(tiny_llama_dir, tmp_path / "sql", seed=1)
    port, key = free_port(), "admin-key-not-on-argv"
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--replicas", "2", "--port",
                             str(port),
                             "--host", "127.0.0.1", "--model", str(tiny_llama_dir), "--dtype", "float32",
                             "--device", "cpu", "--num-kv-blocks", "64", "--max-loras", "1", "--lora-modules",
                             f"sql={adapter}", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PAGEDSERVE_LORA_ADMIN_KEY": key})
    try:
        assert "pagedserve up: 2 replicas" in proc.stdout.readline()
        children = descendant_pids(proc.pid)
        url = f"http://127.0.0.1:{port}"
        listed = {m["id"]: m.get("parent") for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert listed[Path(tiny_llama_dir).name] is None and listed["sql"] == Path(tiny_llama_dir).name
        body = {"model": "sql", "prompt": "select the rows " * 8, "max_tokens": 3}
        first = httpx.post(url + "/v1/completions", timeout=60, json=body)
        again = httpx.post(url + "/v1/completions", timeout=60, json=body)
        assert first.status_code == again.status_code == 200, first.text
        # The router hashes the prompt under the adapter's root, so the second finds the first's blocks.
        assert again.headers["x-pagedserve-replica"] == first.headers["x-pagedserve-replica"]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert not any(key.encode() in b"\0".join(cmdline(pid) or []) for pid in children)
        _interrupt_and_expect_no_orphans(proc, children)
    finally:
        if proc.poll() is None:
            proc.kill()
