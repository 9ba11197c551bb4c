"""A local cluster of real processes (redis-server, 2 engine+scheduler replicas of a tiny random Llama,
2 routers): the openai client through the router, routers agreeing, disconnects, a Redis outage, and an
engine killed under load and restarted."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from services.commands.ports import free_port_run
from services.commands.up import LocalCluster
from tests.e2e.openai_checks import (
    LONG_SYSTEM,
    check_chat_and_completions,
    check_sampling_surface,
    check_stop_strings,
    client,
    kv_usage,
    model_id,
)

# These run the services as real processes: they need the whole engine stack.
pytest.importorskip("services.scheduler.async_scheduler")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    args = SimpleNamespace(
        host="127.0.0.1", port=free_port_run(2), model=str(tiny_llama_dir), served_model_name="tiny", dtype="float32",
        device="cpu", block_size=16, num_kv_blocks=256, kv_cache_memory=None, max_model_len=None, max_num_seqs=8,
        max_num_batched_tokens=None, enable_prefix_caching=None, max_body_bytes=None, log_level="warning",
        policy="prefix", api_keys_file=None, api_keys=None, redis_url=None)
    c = LocalCluster(args, replicas=2, routers=2)
    try:
        c.start(timeout=180)
        yield c
    finally:
        c.stop()


def routed(url: str, system: str, question: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def replica_health(cluster: LocalCluster) -> list[str]:
    return httpx.get(cluster.router_urls[0] + "/health", timeout=5).json()["replicas"]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_openai_client_through_the_router(cluster):
    c = client(cluster.router_urls[0])
    assert model_id(c) == "tiny"
    check_chat_and_completions(c)
    check_stop_strings(c)
    check_sampling_surface(c, cluster.router_urls[0])


def test_two_routers_send_a_prefix_to_the_same_replica(cluster):
    for g in range(4):
        system = f"Group {g}: you catalogue seashells by colour and size. " * 10
        seen = {routed(url, system, f"shell {i}").headers["x-pagedserve-replica"]
                for i, url in enumerate(cluster.router_urls * 3)}
        assert len(seen) == 1, seen


def test_client_disconnect_frees_its_blocks(cluster):
    body = {"model": "tiny", "prompt": "tock " * 40, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.router_urls[0] + "/v1/completions", json=body, timeout=60) as r:
        replica = int(r.headers["x-pagedserve-replica"].split("-")[1])
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    metrics_url = cluster.scheduler_urls[replica] + "/metrics"
    wait_for(lambda: kv_usage(httpx.get(metrics_url).text) == 0, 10, "KV blocks freed after disconnect")


def test_redis_outage_keeps_requests_flowing(cluster):
    cluster.redis.signal(signal.SIGTERM)
    cluster.redis.wait(10)
    try:
        for i in range(4):
            assert routed(cluster.router_urls[i % 2], LONG_SYSTEM, f"outage {i}").status_code == 200
    finally:
        cluster.redis.start()
    wait_for(lambda: len(replica_health(cluster)) == 2, 20, "replicas re-registered in the restarted Redis")
    assert routed(cluster.router_urls[0], LONG_SYSTEM, "after").status_code == 200


def test_killed_engine_fails_clearly_survivors_serve_and_it_rejoins(cluster):
    systems = [f"Fleet {g}: you schedule ferries between islands. " * 10 for g in range(6)]
    victim = 0

    def one(i: int):
        body_stream = i % 2 == 0
        try:
            if body_stream:
                c = openai.OpenAI(base_url=cluster.router_urls[i % 2] + "/v1", api_key="x", max_retries=0, timeout=60)
                text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    model="tiny", max_tokens=200, stream=True, extra_body={"ignore_eos": True},
                    messages=[{"role": "system", "content": systems[i % 6]}, {"role": "user", "content": str(i)}])
                    if ch.choices)
                return "ok", text
            r = routed(cluster.router_urls[i % 2], systems[i % 6], str(i), max_tokens=200, ignore_eos=True)
            return ("ok" if r.status_code == 200 else f"http {r.status_code}"), r.text
        except openai.APIError as exc:
            return "error", str(exc)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        time.sleep(1.0)
        cluster.engines[victim].proc.kill()
        results = [f.result(timeout=90) for f in futures]  # none may hang
    outcomes = [r[0] for r in results]
    assert all(o == "ok" or o == "error" or o.startswith("http 5") for o in outcomes), results
    assert outcomes.count("ok") >= 6, outcomes

    wait_for(lambda: replica_health(cluster) == ["replica-1"], 10, "the dead engine's replica to leave routing")
    for i in range(6):
        r = routed(cluster.router_urls[i % 2], systems[i], f"later {i}")
        assert r.status_code == 200 and r.headers["x-pagedserve-replica"] == "replica-1"

    cluster.engines[victim].start()
    wait_for(lambda: len(replica_health(cluster)) == 2, 60, "the restarted engine's replica to rejoin")
    landed = {routed(cluster.router_urls[0], f"Fresh prefix {i}. " * 40, "q").headers["x-pagedserve-replica"]
              for i in range(6)}
    assert "replica-0" in landed
