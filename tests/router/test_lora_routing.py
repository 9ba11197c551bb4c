"""An adapter resident on one replica of its model, through a real router over real Redis and HTTP replicas:
its requests go where it is resident and carry its digest, and elsewhere when that replica is saturated;
a replica that cannot load it is skipped for the next one; when none can, the client gets a 404 naming it,
never a 5xx; when every replica holding it has left the registry, the others are still asked to load it,
and an adapter unloaded on purpose is gone."""

from __future__ import annotations

import httpx

from services.model_files.lora_files import DIGEST_HEADER, UNAVAILABLE_CODE
from services.registry.model import ReplicaLoad
from tests.router.fake_replicas import MODEL, FakeReplicas
from tests.router.test_models import make_router

DIGEST = "cd" * 32


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=20, json={"model": model, "prompt": prompt, "max_tokens": 2})


def test_an_adapter_resident_on_one_replica_is_routed_there_or_loaded_elsewhere(tokenizer, redis_server):
    with FakeReplicas(redis_server.url, ["a", "b", "c"], tokenizer=tokenizer) as fakes, \
            make_router(redis_server.url) as r:
        fakes.adapters["b"] = {"sql": DIGEST}
        for n in "abc":
            fakes.publish(n, ReplicaLoad())
        got = [complete(r.url, "sql", f"question {i} " * 4) for i in range(10)]
        assert {g.status_code for g in got} == {200}
        assert {g.headers["x-pagedserve-replica"] for g in got} == {"b"}, "resident first, nothing measured"
        sent = [h for h in fakes.headers if h.get(DIGEST_HEADER)]
        assert len(sent) == 10 and {h[DIGEST_HEADER] for h in sent} == {DIGEST}
        base = complete(r.url, MODEL, "the base model")
        assert base.status_code == 200 and DIGEST_HEADER not in fakes.headers[-1]

        # The resident replica is saturated: the request goes to a replica that loads the adapter.
        fakes.publish("b", ReplicaLoad(num_running=8, num_waiting=8))
        spilled = complete(r.url, "sql", "spilled")
        assert spilled.status_code == 200 and spilled.headers["x-pagedserve-replica"] in ("a", "c")
        assert fakes.headers[-1][DIGEST_HEADER] == DIGEST
        fakes.publish("b", ReplicaLoad())

        # The resident replica cannot take it (say its copy was reloaded with other weights): the next is
        # asked, loads it and serves; the client sees a 200.
        fakes.apps["b"].state.mode = "no_lora"
        moved = complete(r.url, "sql", "moved")
        assert moved.status_code == 200 and moved.headers["x-pagedserve-replica"] in ("a", "c")

        # No replica can load it: a 404 naming it, not a 503.
        for n in "ac":
            fakes.apps[n].state.mode = "no_lora"
        nowhere = complete(r.url, "sql", "nowhere")
        assert nowhere.status_code == 404, nowhere.text
        err = nowhere.json()["error"]
        assert err["param"] == "model" and err["code"] == UNAVAILABLE_CODE and "sql" in err["message"]
        for n in "abc":
            fakes.apps[n].state.mode = "ok"

        # Every replica holding it left the registry: the router still knows the name, its parent and digest,
        # and sends it to a replica of the parent, which loads it from the shared directory.
        fakes.remove("b")
        complete(r.url, MODEL, "re-read the registry")
        after = complete(r.url, "sql", "after b left")
        assert after.status_code == 200 and after.headers["x-pagedserve-replica"] in ("a", "c")
        assert fakes.headers[-1][DIGEST_HEADER] == DIGEST
        assert "sql" in {m["id"] for m in httpx.get(r.url + "/v1/models").json()["data"]}

        # Unloaded on purpose by a replica still registered: forgotten, a 404 naming the served models.
        fakes.adapters["a"] = {"sql": DIGEST}
        fakes.publish("a", ReplicaLoad())
        complete(r.url, MODEL, "re-read")
        fakes.adapters["a"] = {}
        fakes.publish("a", ReplicaLoad())
        complete(r.url, MODEL, "re-read again")
        gone = complete(r.url, "sql", "gone")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_hostile_model_names_through_the_router_never_5xx(tokenizer, redis_server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    with FakeReplicas(redis_server.url, ["a", "b"], tokenizer=tokenizer) as fakes, \
            make_router(redis_server.url) as r:
        fakes.adapters["a"] = {"sql": DIGEST}
        fakes.publish("a", ReplicaLoad())
        fakes.apps["b"].state.mode = "no_lora"

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(st.text(max_size=60), st.sampled_from(["sql", "../sql", "sql/..", "SQL", "sql\x00"])))
        def check(name):
            resp = complete(r.url, name, "x")
            assert resp.status_code < 500, (name, resp.text)
            if resp.status_code != 200:
                assert resp.json()["error"]["param"] == "model", resp.text

        check()
