"""Loading a LoRA adapter on demand, with a real tiny Llama engine over HTTP: a request carrying the
router's digest header for an adapter not loaded here loads `<lora-dir>/<name>` once (concurrent requests
share that load) and is served with exactly those weights; other weights, a missing or escaping name, no
room and no --lora-dir are each the retryable 503 `lora_unavailable`; without the header the plain 404
stands."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.model_files.lora_files import DIGEST_HEADER, UNAVAILABLE_CODE, read_adapter
from services.model_files.tokenizer import ModelTokenizer
from services.registry.memory_index import MemoryIndex
from services.replica.service import ReplicaSettings, build_replica
from services.scheduler.executor import InProcessExecutor
from tests.conftest import AppServer
from tests.engine.conftest import make_tiny_model
from tests.engine.lora_adapters import save_random_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_demand")
    model = make_tiny_model(root / "model")
    allowed = root / "adapters"
    allowed.mkdir()
    for seed, name in enumerate(("sql", "chat", "third", "other"), start=1):
        save_random_adapter(model, allowed / name, seed=seed)
    save_random_adapter(model, root / "outside", seed=9)
    os.symlink(root / "outside", allowed / "link_out")
    runner = ModelRunner(EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=256,
                                      max_loras=2, max_lora_rank=16))
    service = build_replica(InProcessExecutor(runner), ModelTokenizer(model), ReplicaSettings(
        served_model_name="base", lora_dir=str(allowed)))
    digests = {p.name: read_adapter(str(p), str(allowed), 16).digest for p in allowed.iterdir() if not p.is_symlink()}
    with AppServer(service.app) as server:
        yield server.url, service, digests
    service.replica.loop.shutdown()


def _complete(url, model, digest=None, prompt="the quick brown fox"):
    headers = {DIGEST_HEADER: digest} if digest is not None else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def _unavailable(r: httpx.Response) -> bool:
    return r.status_code == 503 and r.json()["error"]["code"] == UNAVAILABLE_CODE and r.headers["retry-after"]


def test_a_routed_request_loads_the_adapter_once_and_is_served(setup):
    url, service, digests = setup
    pub = service.publisher(MemoryIndex(), "r1", url, 8, heartbeat_interval=1.0)
    loader = service.on_demand
    before = loader.loads
    assert _complete(url, "sql").status_code == 404, "without the router's digest, a name not loaded is a 404"

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(
                url + "/v1/completions", headers={DIGEST_HEADER: digests["sql"]},
                json={"model": "sql", "prompt": f"request {i}", "max_tokens": 4, "temperature": 0})
                for i in range(8)))

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 8, answers[0].text
    assert loader.loads == before + 1, "eight concurrent requests, one load"
    assert pub.info.adapters["sql"] == digests["sql"], "the registry record names it"
    assert pub.info.adapter_load_seconds > 0, "the load was measured for the routers' cost model"
    # Served with those weights: the same as a client asking by name now that it is loaded.
    assert _complete(url, "sql", digests["sql"]).json()["choices"][0]["text"] == \
        _complete(url, "sql").json()["choices"][0]["text"] != _complete(url, "base").json()["choices"][0]["text"]
    assert loader.loads == before + 1


def test_other_weights_under_a_name_are_refused_retryably(setup):
    url, _, digests = setup
    # Resident under "sql" are other bytes than the router asked for.
    _complete(url, "sql", digests["sql"])
    assert _unavailable(_complete(url, "sql", digests["chat"]))
    # Files in the directory that hash differently from what the router expects are never loaded.
    assert _unavailable(_complete(url, "chat", digests["sql"]))
    assert _complete(url, "chat").status_code == 404, "nothing was loaded under that name"


def test_missing_escaping_and_malformed_names_are_refused(setup):
    url, _, digests = setup
    digest = digests["sql"]
    for name in ("missing", "../outside", "link_out", "sql/..", ".", "a\\b"):
        assert _unavailable(_complete(url, name, digest)), name
    bad = _complete(url, "chat", "not-a-digest")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == DIGEST_HEADER
    # The base model's name with a digest is the base model: no load, no refusal.
    assert _complete(url, "base", digest).status_code == 200


def test_no_room_and_no_lora_dir_are_refused(setup):
    url, service, digests = setup
    loader = service.on_demand
    held = loader.max_adapters
    loader.max_adapters = len(loader.adapters)
    try:
        assert _unavailable(_complete(url, "third", digests["third"]))
    finally:
        loader.max_adapters = held
    lora_dir, service.lora_admin.lora_dir = service.lora_admin.lora_dir, None
    try:
        assert _unavailable(_complete(url, "third", digests["third"]))
    finally:
        service.lora_admin.lora_dir = lora_dir
    assert _complete(url, "third", digests["third"]).status_code == 200

