"""`pagedserve serve` as a real process (tiny random Llama): the official openai client end to end, bad
input, and a client that disconnects mid-stream leaving no KV blocks behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from services.commands.ports import free_port
from tests.e2e.openai_checks import (
    check_bad_input,
    check_chat_and_completions,
    check_sampling_surface,
    check_stop_strings,
    client,
    kv_usage,
)

# These run the services as real processes: they need the whole engine stack.
pytest.importorskip("services.scheduler.async_scheduler")


def start_serve(model_dir, *extra: str, env: dict | None = None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port),
                             "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
                             "--num-kv-blocks", "256", "--max-num-seqs", "8", "--log-level", "warning", *extra],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "pagedserve serve exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=1).json().get("replicas"):
                break
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, "pagedserve serve did not come up"
        time.sleep(0.2)
    return proc, url


@contextlib.contextmanager
def served(model_dir, *extra: str) -> Iterator[str]:
    """`pagedserve serve` for a module's tests: its URL, then a clean exit (0) on terminate."""
    proc, url = start_serve(model_dir, *extra)
    try:
        yield url
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.fixture(scope="module")
def serve_url(tiny_llama_dir):
    with served(tiny_llama_dir) as url:
        yield url


def test_api_keys_isolate_their_prefix_caches(tiny_llama_dir):
    env = {**os.environ, "PAGEDSERVE_API_KEYS": "sk-alice,sk-bob"}
    proc, url = start_serve(tiny_llama_dir, "--cache-isolation", "per-key", env=env)
    try:
        def cached(key: str) -> int:
            body = {"model": "tiny-llama", "prompt": "The lighthouse keeper counts ships. " * 12, "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json={**body, "model": client(url, key).models.list().data[0].id},
                           headers={"authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("sk-alice") == 0
        assert cached("sk-alice") >= 64  # the same tenant hits its own blocks
        assert cached("sk-bob") == 0  # another tenant neither hits nor can time Alice's prompt
    finally:
        proc.terminate()
        proc.wait(30)


def test_openai_client_against_serve(serve_url):
    c = client(serve_url)
    check_chat_and_completions(c)
    check_stop_strings(c)
    check_sampling_surface(c, serve_url)
    check_bad_input(serve_url)
    metrics = httpx.get(serve_url + "/metrics").text
    for name in ("pagedserve_requests_waiting", "pagedserve_time_to_first_token_seconds_bucket",
                 "pagedserve_router_requests_total", "pagedserve_prefix_cache_hits_total"):
        assert name in metrics


def test_disconnect_mid_stream_frees_kv_blocks(serve_url):
    body = {"model": client(serve_url).models.list().data[0].id, "prompt": "tick " * 40, "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", serve_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                # Checked inside the loop: leaving it closes the response (that is the disconnect).
                assert kv_usage(httpx.get(serve_url + "/metrics").text) > 0
                break
    deadline = time.monotonic() + 10
    while kv_usage(httpx.get(serve_url + "/metrics").text) > 0:
        assert time.monotonic() < deadline, "KV blocks of a disconnected client were not freed"
        time.sleep(0.1)
