"""Run-time LoRA adapters on a replica over HTTP, with a real tiny Llama engine: the admin key, every
hostile adapter a 400 naming what is wrong, `/v1/models` listing adapters with their parent, requests
by adapter name, the registry record and vLLM's `lora_requests_info` metric, and loads and unloads
while 50 requests run without failing one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import pytest

from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.model_files.tokenizer import ModelTokenizer
from services.registry.memory_index import MemoryIndex
from services.replica.service import ReplicaSettings, build_replica
from services.scheduler.executor import InProcessExecutor
from tests.conftest import AppServer
from tests.engine.conftest import make_tiny_model
from tests.engine.lora_adapters import save_random_adapter

KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_admin")
    model = make_tiny_model(root / "model")
    allowed = root / "adapters"
    allowed.mkdir()
    save_random_adapter(model, allowed / "A", seed=1)
    save_random_adapter(model, allowed / "B", seed=2)
    save_random_adapter(model, root / "outside", seed=3)
    save_random_adapter(model, allowed / "rank32", seed=4, rank=32)
    runner = ModelRunner(EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=256,
                                      max_loras=2, max_lora_rank=16))
    service = build_replica(InProcessExecutor(runner), ModelTokenizer(model), ReplicaSettings(
        served_model_name="base", lora_modules=[f"B={allowed / 'B'}"], lora_dir=str(allowed), lora_admin_key=KEY))
    with AppServer(service.app) as server:
        yield server.url, service, allowed, root
    service.replica.loop.shutdown()


def _post(url, path, body, headers=ADMIN):
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def _complete(url, model, prompt="the quick brown fox", max_tokens=6):
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0}, timeout=120)


def test_admin_key_is_required(setup):
    url, *_ = setup
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "A"}, {}).status_code == 401
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "A"}, {"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"


def _hostile(allowed, root):
    """(body, field the 400 must name) for every kind of bad adapter."""
    link = allowed / "link_out"
    if not link.exists():
        os.symlink(root / "outside", link)
    pickled = allowed / "pickled"
    if not pickled.exists():
        pickled.mkdir()
        shutil.copy(allowed / "A" / "adapter_config.json", pickled)
        (pickled / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    file_link = allowed / "file_link"
    if not file_link.exists():
        file_link.mkdir()
        shutil.copy(allowed / "A" / "adapter_config.json", file_link)
        os.symlink(root / "outside" / "adapter_model.safetensors", file_link / "adapter_model.safetensors")
    no_b = allowed / "no_b"
    if not no_b.exists():
        from safetensors.torch import load_file, save_file

        no_b.mkdir()
        shutil.copy(allowed / "A" / "adapter_config.json", no_b)
        tensors = load_file(allowed / "A" / "adapter_model.safetensors")
        tensors.pop(next(k for k in tensors if "lora_B" in k))
        save_file(tensors, no_b / "adapter_model.safetensors")
    return [
        ({"lora_name": "x", "lora_path": "../outside"}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(root / "outside")}, "lora_path"),
        ({"lora_name": "x", "lora_path": "link_out"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "file_link"}, "adapter_model.safetensors"),
        ({"lora_name": "x", "lora_path": "pickled"}, "adapter_model.bin"),
        ({"lora_name": "x", "lora_path": "rank32"}, "r"),
        ({"lora_name": "x", "lora_path": "no_b"}, "lora_B"),
        ({"lora_name": "x", "lora_path": "missing"}, "lora_path"),
        ({"lora_name": "", "lora_path": "A"}, "lora_name"),
        ({"lora_name": "base", "lora_path": "A"}, "lora_name"),
        ({"lora_name": "x", "lora_path": 7}, "lora_path"),
        ({"lora_name": "x", "lora_path": "A", "extra": 1}, "extra"),
    ]


def test_every_bad_adapter_is_a_400_naming_what_is_wrong(setup):
    url, _, allowed, root = setup
    for body, field in _hostile(allowed, root):
        r = _post(url, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert field in (err["param"] or "") + err["message"], (body, err)
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "never"}).status_code == 404


def test_load_serve_list_unload(setup):
    url, service, *_ = setup
    pub = service.publisher(MemoryIndex(), "r1", url, 8, heartbeat_interval=1.0)
    assert set(pub.info.adapters) == {"B"}
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "A"})
    assert r.status_code == 200, r.text
    digest = r.json()["digest"]
    assert pub.info.adapters["A"] == digest, "the registry record names the resident adapters"
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert models["A"]["parent"] == "base" and models["B"]["parent"] == "base" and models["base"].get("parent") is None
    base, a, b = (_complete(url, m).json()["choices"][0]["text"] for m in ("base", "A", "B"))
    assert len({base, a, b}) == 3, "each adapter changes the output"
    assert _complete(url, "A").json()["choices"][0]["text"] == a
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "A"})
    assert r.status_code == 200
    assert _complete(url, "A").status_code == 404
    assert set(pub.info.adapters) == {"B"}
    assert "A" not in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_metrics_name_the_adapters(setup):
    url, *_ = setup
    text = httpx.get(url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line


def test_loads_and_unloads_during_a_run_fail_no_request(setup):
    url, *_ = setup
    _post(url, "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": "A"})

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i):
                model = ("base", "A", "B")[i % 3]
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": f"request {i} says", "max_tokens": 8, "temperature": 0})
                return r.status_code, r.text

            async def churn():
                for k in range(6):
                    await asyncio.sleep(0.05)
                    # Reload B in place and load/unload a spare name while A and B requests run.
                    for body, path in (({"lora_name": "B", "lora_path": "B"}, "/v1/load_lora_adapter"),
                                       ({"lora_name": f"spare{k}", "lora_path": "A"}, "/v1/load_lora_adapter"),
                                       ({"lora_name": f"spare{k}"}, "/v1/unload_lora_adapter")):
                        r = await client.post(url + path, json=body, headers=ADMIN)
                        assert r.status_code == 200, r.text

            results = await asyncio.gather(*(one(i) for i in range(50)), churn())
            return results[:50]

    results = asyncio.run(main())
    failed = [(s, t) for s, t in results if s != 200]
    assert not failed, failed[:3]
    assert all(json.loads(t)["usage"]["completion_tokens"] == 8 for _, t in results)
