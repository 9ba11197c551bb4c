"""The router's waiting room against real Redis and real HTTP replicas: requests held while no replica is
ready (scale from zero) are served once one registers, time out with a clear 503, share the queue's
bound, and show in a gauge that exists at 0 before the first request (the KEDA scale-from-zero signal)."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from services.contracts import metric_names as M
from services.registry.model import ReplicaLoad
from services.registry.redis_sink import connect
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.redis_index import RedisIndex
from services.router.service import RouterConfig, RouterService
from tests.conftest import AppServer
from tests.router.fake_replicas import FakeReplicas
from tests.router.test_service import chat


def make_router(tokenizer, redis_url: str, cold_start: float, max_queue: int = 16) -> AppServer:
    config = RouterConfig(max_queue=max_queue, request_timeout=10.0, cold_start_timeout=cold_start)
    index = RedisIndex(connect(redis_url), record_refresh=0)
    return AppServer(create_router_app(RouterService(config, tokenizer, index, ApiKeys([]))))


def gauge(url: str, name: str) -> float | None:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(url + "/metrics").text, re.M)
    return float(found.group(1)) if found else None


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_requests_are_held_until_the_first_replica_registers(tokenizer, redis_server):
    fakes = FakeReplicas(redis_server.url, ["a"])
    with make_router(tokenizer, redis_server.url, cold_start=30) as r:
        # Present before any request: the autoscaler sees a step 0 -> 1, not a series born at 1.
        assert gauge(r.url, M.ROUTER_REQUESTS_HELD) == 0.0
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            held = [pool.submit(chat, r.url, f"cold {i}") for i in range(3)]
            wait_for(lambda: gauge(r.url, M.ROUTER_REQUESTS_HELD) == 3.0)
            assert httpx.get(r.url + "/health").json()["held"] == 3
            assert not any(f.done() for f in held)
            with fakes:  # the replica's pod became ready and registered
                answers = [f.result(20) for f in held]
                assert [a.status_code for a in answers] == [200, 200, 200]
                assert {a.headers["x-pagedserve-replica"] for a in answers} == {"a"}
        assert gauge(r.url, M.ROUTER_REQUESTS_HELD) == 0.0


def test_held_requests_time_out_with_a_clear_503(tokenizer, redis_server):
    with make_router(tokenizer, redis_server.url, cold_start=0.6) as r:
        started = time.monotonic()
        resp = chat(r.url, "nobody home")
        assert time.monotonic() - started >= 0.6
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "no_replicas"
        assert "no replica became ready within 0.6s" in resp.json()["error"]["message"]
        assert gauge(r.url, M.ROUTER_REQUESTS_HELD) == 0.0


def test_without_a_cold_start_timeout_no_replica_is_a_503_at_once(tokenizer, redis_server):
    with make_router(tokenizer, redis_server.url, cold_start=0) as r:
        started = time.monotonic()
        resp = chat(r.url, "nobody home")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_replicas"
        assert time.monotonic() - started < 2


def test_held_requests_share_the_queue_bound(tokenizer, redis_server):
    with make_router(tokenizer, redis_server.url, cold_start=5, max_queue=1) as r, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(chat, r.url, "held")
        wait_for(lambda: gauge(r.url, M.ROUTER_REQUESTS_HELD) == 1.0)
        over = chat(r.url, "over the bound")
        assert over.status_code == 503 and over.json()["error"]["code"] == "no_replicas"
        assert not first.done()
        with FakeReplicas(redis_server.url, ["a"]):
            assert first.result(10).status_code == 200


@pytest.mark.parametrize("load", [ReplicaLoad(healthy=False)])
def test_registered_but_unhealthy_replicas_hold_too(tokenizer, redis_server, load):
    with FakeReplicas(redis_server.url, ["a"]) as fakes, make_router(tokenizer, redis_server.url, cold_start=10) as r:
        fakes.publish("a", load)  # its engine restarts: registered, not ready
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, r.url, "wait for the engine")
            wait_for(lambda: gauge(r.url, M.ROUTER_REQUESTS_HELD) == 1.0)
            fakes.publish("a", ReplicaLoad())
            assert held.result(10).status_code == 200
