"""Tensor-parallel engines as real processes (tiny random Llama, 2 ranks over gloo): `pagedserve serve`
whose rank 1 is killed mid-stream fails the stream with a clear engine error and comes back as a
whole new group; `pagedserve up --tensor-parallel-size 2` serves and Ctrl-C stops every rank; a rank 0
that hangs is left by its rank within the timeout, and rank 0 then goes down too instead of serving
with half a model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.commands.ports import free_port
from services.transport.remote_executor import RemoteExecutor
from tests.e2e.test_serve import start_serve
from tests.e2e.test_up import _alive
from tests.proc_children import descendant_pids

pytest.importorskip("services.scheduler.async_scheduler")


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except FileNotFoundError:
        return []


def _ranks(root: int) -> tuple[list[int], list[int]]:
    """(rank-0 engine pids, engine-worker pids) under process `root`."""
    procs = {pid: _argv(pid) for pid in descendant_pids(root)}
    engines = [pid for pid, argv in procs.items() if "engine" in argv and "--tensor-parallel-size" in argv]
    workers = [pid for pid, argv in procs.items() if "engine-worker" in argv]
    return engines, workers


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0})


def test_serve_fails_a_stream_clearly_when_a_rank_dies_and_restarts_the_group(tiny_llama_dir):
    proc, url = start_serve(tiny_llama_dir, "--tensor-parallel-size", "2")
    model = Path(tiny_llama_dir).name
    try:
        before = _complete(url, model)
        assert before.status_code == 200, before.text
        (engine,), (worker,) = _ranks(proc.pid)
        body = {"model": model, "prompt": "tick " * 20, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 5:  # mid-generation: steps are running back to back
                    subprocess.run(["kill", "-9", str(worker)], check=True)
        assert events[-1] != "[DONE]", "the stream claimed success after its engine lost a rank"
        error = json.loads(events[-1])["error"]
        assert error["code"] == "engine_error" and "engine" in error["message"], error
        assert len(events) < 200, "the stream went on long after the rank died"
        # The whole group goes down (rank 0 follows its rank) and serve starts a new one.
        _wait(lambda: not _alive(engine), 30, "rank 0 outlived its killed rank")
        _wait(lambda: (lambda e, w: len(e) == 1 and len(w) == 1 and e[0] != engine)(*_ranks(proc.pid)), 120,
              "no new group was started")
        after = _wait(lambda: (r := _complete(url, model)).status_code == 200 and r, 120,
                      "the replica did not come back with the new group")
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]  # same model, greedy
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_up_runs_two_ranks_per_replica_and_ctrl_c_stops_them(tiny_llama_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "up", "--replicas", "1", "--port",
                             str(port),
                             "--host", "127.0.0.1", "--model", str(tiny_llama_dir), "--dtype", "float32",
                             "--device", "cpu", "--num-kv-blocks", "128", "--tensor-parallel-size", "2",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    try:
        assert "pagedserve up: 1 replicas" in proc.stdout.readline()
        engines, workers = _ranks(proc.pid)
        assert len(engines) == 1 and len(workers) == 1
        r = _complete(f"http://127.0.0.1:{port}", Path(tiny_llama_dir).name)
        assert r.status_code == 200, r.text
        children = descendant_pids(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _wait(lambda: not any(_alive(pid) for pid in children), 15, "a rank outlived pagedserve up")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_hung_rank_zero_is_left_by_its_rank_within_the_timeout(tiny_llama_dir):
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "engine", "--port", str(port), "--model",
                               str(tiny_llama_dir), "--dtype", "float32", "--num-kv-blocks", "32",
                               "--tensor-parallel-size", "2", "--tp-timeout", "3", "--log-level", "warning"],
                              stderr=subprocess.PIPE, text=True)
    executor = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=10)
    try:
        executor.wait_ready(120)
        (worker,) = _ranks(engine.pid)[1]
        engine.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _wait(lambda: not _alive(worker), 30, "rank 1 waited forever for a hung rank 0")
        # Its last heartbeat came up to a heartbeat period (about 1 s here) before the stop; then 3 s passed.
        assert 1.0 < time.monotonic() - stopped < 30
        engine.send_signal(signal.SIGCONT)
        assert engine.wait(30) == 1, "rank 0 went on serving without its rank"
        assert "rank 1 (pid" in engine.stderr.read()
    finally:
        executor.close()
        if engine.poll() is None:
            engine.send_signal(signal.SIGCONT)
            engine.kill()
