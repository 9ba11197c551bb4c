"""Several models and their adapters behind one router, against real Redis and real HTTP replicas: each
model's tokenizer and chat template learned (and verified) from the registry with no copy at the router,
routing by `model`, a 404 naming the served models, /v1/models listing adapters with their parent, one
admission queue per model, and adapter requests hashed under the adapter's root and sent where it is
resident."""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import httpx
import pytest

from services.contracts.block_hash import adapter_seed, hash_blocks, model_hash_seed
from services.model_files.tokenizer import ModelTokenizer
from services.registry import keys
from services.registry.model import ReplicaLoad
from services.registry.redis_sink import connect
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.redis_index import RedisIndex
from services.router.service import RouterConfig, RouterService
from tests.conftest import AppServer
from tests.router.fake_replicas import BLOCK, MODEL, FakeReplicas

OTHER = "other-model"
SYSTEM = "You are a meticulous assistant for a shipping company. " * 12
DIGEST_A = "aa" * 32
DIGEST_A2 = "ab" * 32


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """The bundled tokenizer with a chat template of its own: another model's, as far as the router knows."""
    from services.model_files.model_source import resolve_model

    src, out = resolve_model(None), tmp_path_factory.mktemp("other-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}### {{ m['role'] | upper }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### ASSISTANT\n{% endif %}")
    return ModelTokenizer(out)


def make_router(redis_url: str, max_queue: int = 16, local=None, request_timeout: float = 10.0) -> AppServer:
    """A router with no tokenizer of its own (local=None): everything it knows comes from the registry."""
    config = RouterConfig(max_queue=max_queue, request_timeout=request_timeout)
    index = RedisIndex(connect(redis_url), record_refresh=0)
    return AppServer(create_router_app(RouterService(config, local, index, ApiKeys([]))))


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat(url: str, model: str, question: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                          "messages": messages(question)}, timeout=20)


def test_two_models_route_by_name_with_their_own_tokenizers(tokenizer, other_tokenizer, redis_server):
    assert tokenizer.digest != other_tokenizer.digest
    with FakeReplicas(redis_server.url, ["a1", "a2"], tokenizer=tokenizer) as smol, \
            FakeReplicas(redis_server.url, ["b1", "b2"], model=OTHER, tokenizer=other_tokenizer) as other, \
            make_router(redis_server.url) as r:
        for i in range(4):
            for model, fakes, tok in ((MODEL, smol, tokenizer), (OTHER, other, other_tokenizer)):
                resp = chat(r.url, model, f"question {i}")
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-pagedserve-replica"] in fakes.servers
                # Tokenized with that model's own template, learned from the registry.
                assert resp.json()["prompt_token_ids"] == tok.apply_chat_template(messages(f"question {i}"))
        ids = tokenizer.apply_chat_template(messages("x"))
        assert ids != other_tokenizer.apply_chat_template(messages("x"))
        listed = httpx.get(r.url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == sorted([(MODEL, None), (OTHER, None)])
        missing = chat(r.url, "nope", "x")
        assert missing.status_code == 404
        assert missing.json()["error"]["param"] == "model"
        assert MODEL in missing.json()["error"]["message"] and OTHER in missing.json()["error"]["message"]
        # /tokenize is answered with the named model's tokenizer.
        tok = httpx.post(r.url + "/tokenize", json={"model": OTHER, "prompt": "hello world"}).json()
        assert tok["tokens"] == other_tokenizer.encode("hello world")
        several = httpx.post(r.url + "/tokenize", json={"prompt": "hello"})
        assert several.status_code == 400 and several.json()["error"]["param"] == "model"


def test_a_bundle_that_does_not_match_its_digest_is_never_used(tokenizer, redis_server):
    import redis

    with FakeReplicas(redis_server.url, ["a"], tokenizer=tokenizer), make_router(redis_server.url) as r:
        client = redis.Redis.from_url(redis_server.url)
        key = keys.tokenizer_key(keys.DEFAULT_NAMESPACE, tokenizer.digest)
        client.set(key, tokenizer.bundle.replace(b"{{", b"{{ ", 1))  # one byte of template changed
        resp = chat(r.url, MODEL, "tampered")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "tokenizer_mismatch"
        client.set(key, tokenizer.bundle)
        assert chat(r.url, MODEL, "restored").status_code == 200


def test_replicas_without_a_published_tokenizer_use_the_routers_own(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a"]):  # an older replica: no digest in its record
        with make_router(redis_server.url) as bare:
            resp = chat(bare.url, MODEL, "x")
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_tokenizer"
        with make_router(redis_server.url, local=tokenizer) as r:
            assert chat(r.url, MODEL, "x").json()["prompt_token_ids"] == tokenizer.apply_chat_template(messages("x"))


def test_one_models_burst_cannot_starve_another(tokenizer, other_tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a"], capacity=1, tokenizer=tokenizer) as smol, \
            FakeReplicas(redis_server.url, ["b"], capacity=1, model=OTHER, tokenizer=other_tokenizer) as other, \
            make_router(redis_server.url, max_queue=2, request_timeout=120) as r:  # A's burst waits it out
        # B's tokenizer learned first, so B's timing below is its queue alone, not a registry fetch on a busy machine.
        assert chat(r.url, OTHER, "b warms up").status_code == 200
        smol.publish("a", ReplicaLoad(num_running=1, num_waiting=1))  # model A saturated
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            burst = [pool.submit(chat, r.url, MODEL, f"burst {i}") for i in range(2)]
            deadline = time.monotonic() + 60  # generous: the first request also learns the tokenizer
            gauge = f'pagedserve_router_model_queue_depth{{model="{MODEL}"}} 2.0'
            while gauge not in httpx.get(r.url + "/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert chat(r.url, MODEL, "one more").status_code == 429  # A's own bound is full
            # B's replica is saturated too for a moment: its request queues in B's queue, not a 429.
            other.publish("b", ReplicaLoad(num_running=1, num_waiting=1))
            started = time.monotonic()
            queued_b = pool.submit(chat, r.url, OTHER, "b waits its turn")
            time.sleep(0.3)
            other.publish("b", ReplicaLoad())
            assert queued_b.result(30).status_code == 200
            assert time.monotonic() - started < 30  # B's own turn, not A's (A is still saturated below)
            assert chat(r.url, OTHER, "b at once").status_code == 200
            assert not any(f.done() for f in burst)  # A is still saturated
            smol.publish("a", ReplicaLoad())
            assert [f.result(10).status_code for f in burst] == [200, 200]


def test_adapter_requests_go_where_it_is_resident_under_its_own_root(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b", "c"], tokenizer=tokenizer) as fakes, \
            make_router(redis_server.url) as r:
        fakes.adapters["b"] = {"sql": DIGEST_A}
        fakes.adapters["c"] = {"sql": DIGEST_A2}  # the same name, other weights: a stale copy elsewhere
        fakes.adapters["a"] = {"chat": DIGEST_A2}
        for n in ("a", "b", "c"):
            fakes.publish(n, ReplicaLoad())
        listed = {m["id"]: m["parent"] for m in httpx.get(r.url + "/v1/models").json()["data"]}
        assert listed == {MODEL: None, "sql": MODEL, "chat": MODEL}
        # Replicas disagree on "sql"'s weights (a reload rolling out): the digest most hold wins, ties to the
        # greater one (DIGEST_A2, on c); on idle replicas residency breaks the tie, every time.
        got = {chat(r.url, "sql", f"q{i}").headers["x-pagedserve-replica"] for i in range(6)}
        assert got == {"c"}
        fakes.adapters["a"] = {"chat": DIGEST_A2, "sql": DIGEST_A}  # now two replicas hold DIGEST_A
        fakes.publish("a", ReplicaLoad())
        chat(r.url, "sql", "warm")  # resolved on the records of the request before: those are read now
        got = {chat(r.url, "sql", f"q{i}").headers["x-pagedserve-replica"] for i in range(6)}
        assert got <= {"a", "b"} and len(got) >= 1
        # The adapter's blocks are chained under its own root: a prefix cached on b for it brings it there,
        # and the base model's blocks of the same prompt (stored on a) do not count for it.
        ids = tokenizer.apply_chat_template(messages("cached"))
        seed = model_hash_seed(MODEL, BLOCK)
        fakes.store_blocks("b", hash_blocks(ids, BLOCK, adapter_seed(seed, DIGEST_A)))
        fakes.store_blocks("a", hash_blocks(ids, BLOCK, seed))
        for _ in range(3):
            assert chat(r.url, "sql", "cached").headers["x-pagedserve-replica"] == "b"
            assert chat(r.url, MODEL, "cached").headers["x-pagedserve-replica"] == "a"


def test_any_model_name_is_a_404_naming_the_served_models_or_served(tokenizer, redis_server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    with FakeReplicas(redis_server.url, ["a"], tokenizer=tokenizer), make_router(redis_server.url) as r:
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.text(max_size=80))
        def check(name):
            resp = httpx.post(r.url + "/v1/chat/completions", timeout=20,
                              json={"model": name, "messages": [{"role": "user", "content": "x"}]})
            if name == MODEL:
                assert resp.status_code == 200
            else:
                assert resp.status_code in (400, 404), resp.text
                assert resp.json()["error"]["param"] == "model"
                if resp.status_code == 404:
                    assert MODEL in resp.json()["error"]["message"]

        check()
