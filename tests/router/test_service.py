"""The router against real Redis and real HTTP replicas (scripted ones: routing, not generation, is
under test here): prefix affinity, agreement between routers, hot-spot guard, retries, API keys,
queueing with 429, Redis outages, policies and bad input."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from services.commands.ports import free_port
from services.contracts.block_hash import hash_blocks
from services.contracts.internal_auth import InternalToken
from services.registry.model import ReplicaLoad
from services.registry.redis_sink import connect
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.redis_index import RedisIndex
from services.router.service import RouterConfig, RouterService
from tests.conftest import AppServer
from tests.router.fake_replicas import BLOCK, MODEL, SEED, FakeReplicas

SYSTEM = "You are a meticulous assistant for a shipping company. " * 12


def make_router(tokenizer, redis_url: str, policy: str = "prefix", keys: list[str] | None = None,
                max_queue: int = 16, token: InternalToken | None = None) -> AppServer:
    config = RouterConfig(policy=policy, max_queue=max_queue, request_timeout=10.0)
    index = RedisIndex(connect(redis_url), signer=token, record_refresh=0)  # the registry's latest word
    service = RouterService(config, tokenizer, index, ApiKeys(keys or []), internal_token=token)
    return AppServer(create_router_app(service))


def chat(url: str, question: str, system: str = SYSTEM, **kw) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=20, **kw)


def chat_hashes(tokenizer, question: str, system: str = SYSTEM) -> tuple[list[int], list[int]]:
    ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return ids, hash_blocks(ids, BLOCK, SEED)


def test_router_tokenizer_matches_transformers(tokenizer, hf_smol_tokenizer):
    def hf_chat(messages):
        ids = hf_smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ünïcode ✓"}]
    assert tokenizer.apply_chat_template(msgs) == hf_chat(msgs)
    assert tokenizer.apply_chat_template(msgs[1:2]) == hf_chat(msgs[1:2])
    assert tokenizer.encode("plain text") == hf_smol_tokenizer.encode("plain text", add_special_tokens=True)
    text = "decode ✓ <|im_end|> back"
    ids = hf_smol_tokenizer.encode(text)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip) == hf_smol_tokenizer.decode(ids, skip_special_tokens=skip)


def test_prefix_affinity_token_ids_forwarded_and_two_routers_agree(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b", "c"]) as fakes, \
            make_router(tokenizer, redis_server.url) as r1, make_router(tokenizer, redis_server.url) as r2:
        ids, hashes = chat_hashes(tokenizer, "Where is parcel 1?")
        fakes.store_blocks("b", hashes[:-1])
        resp = chat(r1.url, "Where is parcel 1?")
        assert resp.status_code == 200 and resp.headers["x-pagedserve-replica"] == "b"
        assert resp.json()["prompt_token_ids"] == ids  # tokenized once, by the router
        assert resp.json()["prepared"]  # and sent prepared: the replica derives nothing again

        # A prefix nobody caches yet: both routers pick the same replica, also before it publishes blocks.
        other = "You route container ships across the Pacific. " * 12
        first = chat(r1.url, "Q1", system=other).headers["x-pagedserve-replica"]
        for i in range(4):
            assert chat(r2.url, f"Q{i + 2}", system=other).headers["x-pagedserve-replica"] == first
            assert chat(r1.url, f"Q{i + 9}", system=other).headers["x-pagedserve-replica"] == first

        # Hot-spot guard: the replica with the prefix is far busier than the others; load wins.
        fakes.publish("b", ReplicaLoad(num_running=8, num_waiting=4))
        assert chat(r2.url, "Where is parcel 2?").headers["x-pagedserve-replica"] != "b"
        # Unhealthy (engine down) replicas get nothing.
        fakes.publish("b", ReplicaLoad(healthy=False))
        fakes.store_blocks("a", hashes[:-1])
        fakes.publish("a", ReplicaLoad(healthy=False))
        assert chat(r1.url, "Where is parcel 3?").headers["x-pagedserve-replica"] == "c"
        metrics = httpx.get(r1.url + "/metrics").text
        assert 'pagedserve_router_routing_decisions_total{policy="prefix",replica="b"}' in metrics
        assert "pagedserve_router_healthy_replicas 1.0" in metrics


def test_retry_on_dead_or_failing_replica_then_clear_error(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b"]) as fakes, make_router(tokenizer, redis_server.url) as r:
        _, hashes = chat_hashes(tokenizer, "retry me")
        fakes.publish("a", ReplicaLoad(), url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
        fakes.store_blocks("a", hashes)
        resp = chat(r.url, "retry me")
        assert resp.status_code == 200 and resp.headers["x-pagedserve-replica"] == "b"
        fakes.apps["b"].state.mode = "500"
        resp = chat(r.url, "retry me")
        assert resp.status_code == 503 and "no replica could serve" in resp.json()["error"]["message"]
        metrics = httpx.get(r.url + "/metrics").text
        assert "pagedserve_router_retries_total 2.0" in metrics
        assert 'pagedserve_router_requests_total{status="503"} 1.0' in metrics


def test_a_request_that_failed_itself_is_not_retried_and_full_replicas_are_a_429(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b", "c"]) as fakes, make_router(tokenizer, redis_server.url) as r:
        for app in fakes.apps.values():
            app.state.mode = "poison"
        resp = chat(r.url, "poison")
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "request_failed"
        assert sum(fakes.who().values()) == 1, "a poison request must not spread to other replicas"
        for app in fakes.apps.values():
            app.state.mode = "full"
        resp = chat(r.url, "full")
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"
        fakes.apps["b"].state.mode = "ok"
        assert chat(r.url, "one has room").headers["x-pagedserve-replica"] == "b"


def test_with_an_internal_token_forged_records_are_ignored_and_replicas_get_the_token(tokenizer, redis_server):
    token = InternalToken.generate()
    with FakeReplicas(redis_server.url, ["forged"]) as forged, make_router(tokenizer, redis_server.url,
                                                                           token=token) as r:
        resp = chat(r.url, "where do prompts go?")
        assert resp.status_code == 503 and forged.who() == {"forged": 0}  # unsigned: never a target
        with FakeReplicas(redis_server.url, ["real"], signer=token) as real:
            time.sleep(0.6)  # a router re-reads the registry for an unknown model at most every 0.5 s
            resp = chat(r.url, "where do prompts go?")
            assert resp.status_code == 200 and resp.headers["x-pagedserve-replica"] == "real"
            assert real.headers[-1].get("x-pagedserve-internal-token") == token.value
        forged.signer = InternalToken.generate()  # signed, but with another cluster's token
        forged.publish("forged", ReplicaLoad())
        time.sleep(0.6)
        assert chat(r.url, "again").status_code == 503 and forged.who() == {"forged": 0}


def test_streaming_relay_and_api_keys(tokenizer, redis_server, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nsk-one\n")
    keys = ApiKeys.from_sources(str(keys_file), "sk-two")
    with FakeReplicas(redis_server.url, ["a"]):
        config = RouterConfig()
        service = RouterService(config, tokenizer, RedisIndex(connect(redis_server.url), record_refresh=0), keys)
        with AppServer(create_router_app(service)) as r:
            assert chat(r.url, "x").status_code == 401
            bad = chat(r.url, "x", headers={"authorization": "Bearer sk-three"})
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
            assert chat(r.url, "x", headers={"authorization": "Bearer sk-two"}).status_code == 200
            body = {"model": MODEL, "prompt": "hello", "stream": True}
            with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=10,
                              headers={"authorization": "Bearer sk-one"}) as resp:
                assert resp.headers["x-pagedserve-replica"] == "a"
                lines = [x for x in resp.iter_lines() if x.startswith("data:")]
            assert lines[-1] == "data: [DONE]" and len(lines) == 4


def test_saturated_replicas_queue_then_429(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a"], capacity=1) as fakes, \
            make_router(tokenizer, redis_server.url, max_queue=1) as r:
        fakes.publish("a", ReplicaLoad(num_running=1, num_waiting=1))  # saturated: 2 x capacity
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            queued = pool.submit(chat, r.url, "queued")
            time.sleep(0.3)
            rejected = chat(r.url, "over the bound")
            assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
            assert "pagedserve_router_queue_depth 1.0" in httpx.get(r.url + "/metrics").text
            assert not queued.done()
            fakes.publish("a", ReplicaLoad(num_running=1))  # room again
            assert queued.result(10).status_code == 200


def test_redis_down_routes_on_load_and_recovers(tokenizer, private_redis):
    with FakeReplicas(private_redis.url, ["a", "b"]), make_router(tokenizer, private_redis.url) as r:
        assert chat(r.url, "before").status_code == 200
        private_redis.stop()
        answered = {chat(r.url, f"during {i}").status_code for i in range(4)}
        assert answered == {200}
        private_redis.start()
        # Redis came back empty: until the replicas' publishers re-register, the last view still serves.
        assert chat(r.url, "after").status_code == 200


def test_round_robin_and_session_policies(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b", "c"]), \
            make_router(tokenizer, redis_server.url, policy="round-robin") as rr, \
            make_router(tokenizer, redis_server.url, policy="session") as ss:
        assert sorted(chat(rr.url, "same").headers["x-pagedserve-replica"] for _ in range(3)) == ["a", "b", "c"]
        for session in ("alice", "bob", "carol"):
            got = {chat(ss.url, f"q{i}", headers={"x-session-id": session}).headers["x-pagedserve-replica"]
                   for i in range(3)}
            assert len(got) == 1


@pytest.mark.parametrize("body,status", [
    (b"{oops", 400),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"model": MODEL}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": ["x"]}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400),
])
def test_bad_input_never_reaches_a_replica(tokenizer, redis_server, body, status):
    with FakeReplicas(redis_server.url, ["a"]) as fakes, make_router(tokenizer, redis_server.url) as r:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        resp = httpx.post(r.url + "/v1/chat/completions", timeout=10, **kwargs)
        assert resp.status_code == status and resp.json()["error"]["message"]
        big = httpx.post(r.url + "/v1/completions", content=b"x" * (10 << 20), timeout=30)
        assert big.status_code == 413
        assert fakes.who() == {"a": 0}
        assert chat(r.url, "fine").status_code == 200


def test_responses_are_routed_as_the_chat_they_render_to_and_bad_ones_stop_at_the_router(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b"]) as fakes, make_router(tokenizer, redis_server.url) as r:
        ids, hashes = chat_hashes(tokenizer, "Where is parcel 1?")
        fakes.store_blocks("b", hashes[:-1])
        body = {"model": MODEL, "instructions": SYSTEM, "input": "Where is parcel 1?", "max_output_tokens": 4}
        resp = httpx.post(r.url + "/v1/responses", json=body, timeout=20)
        assert resp.status_code == 200 and resp.headers["x-pagedserve-replica"] == "b"
        assert resp.json()["prompt_token_ids"] == ids
        for bad, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                           ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
                            "input.0.call_id"),
                           ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "auto", "text": {
                               "format": {"type": "text"}}, "max_output_tokens": 10**6}, "max_output_tokens")]:
            resp = httpx.post(r.url + "/v1/responses", json={**body, **bad}, timeout=20)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        assert fakes.who() == {"a": 0, "b": 1}


def test_tokenize_and_detokenize_are_answered_by_the_router(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a"]) as fakes, make_router(tokenizer, redis_server.url) as r:
        ids = tokenizer.encode("Where is parcel 1?")
        for body in ({"model": MODEL, "prompt": "Where is parcel 1?"}, {"prompt": "Where is parcel 1?"}):
            resp = httpx.post(r.url + "/tokenize", json=body, timeout=10)
            assert resp.status_code == 200, resp.text
            assert resp.json()["tokens"] == ids and resp.json()["count"] == len(ids)
        back = httpx.post(r.url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=10)
        assert back.json() == {"prompt": "Where is parcel 1?"}
        assert httpx.post(r.url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10).status_code == 404
        bad = httpx.post(r.url + "/detokenize", json={"model": MODEL, "tokens": [10**6]}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert fakes.who() == {"a": 0}  # no replica was involved
