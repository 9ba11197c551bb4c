"""Stand-in schedulers for router tests: real HTTP servers that report who answered and what they got,
registered in a real Redis through the scheduler's own registry writer."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.contracts.block_hash import model_hash_seed
from services.openai_api.prepared_wire import HEADER as PREPARED_HEADER
from services.registry.model import BlockDelta, ReplicaInfo, ReplicaLoad, ReplicaState
from services.registry.redis_sink import RedisSink, connect
from tests.conftest import AppServer

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
SEED = model_hash_seed(MODEL, BLOCK)


def replica_app(name: str, seen: list, headers: list) -> FastAPI:
    app = FastAPI()
    # "ok" | "500" (an engine outage: 503) | "poison" (the request failed: 500) | "full" | "slow" | "no_lora"
    # (cannot load the adapter the request names)
    app.state.mode = "ok"

    async def answer(request: Request):
        body = await request.json()
        seen.append(body)
        headers.append(dict(request.headers))
        if app.state.mode == "500":
            return JSONResponse({"error": {"message": "engine down"}}, status_code=503)
        if app.state.mode == "poison":
            return JSONResponse({"error": {"message": "the engine failed on this request", "code": "request_failed"}},
                                status_code=500)
        if app.state.mode == "full":
            return JSONResponse({"error": {"message": "queue is full", "code": "queue_full"}}, status_code=503,
                                headers={"Retry-After": "1"})
        if app.state.mode == "no_lora":
            return JSONResponse({"error": {"message": "cannot load it here", "param": "model",
                                           "code": "lora_unavailable"}}, status_code=503, headers={"Retry-After": "1"})
        if app.state.mode == "slow":
            await asyncio.sleep(0.5)
        if body.get("stream"):
            async def events():
                for i in range(3):
                    yield "data: " + json.dumps({"replica": name, "i": i}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        # Chat and completions arrive as the router prepared them (services.openai_api.prepared_wire);
        # /v1/responses as its body plus the token ids.
        prepared = request.headers.get(PREPARED_HEADER) == "1"
        ids = body["prompts"][0] if prepared else body.get("prompt_token_ids")
        return {"replica": name, "prompt_token_ids": ids, "prepared": prepared}

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    app.post("/v1/responses")(answer)
    return app


class FakeReplicas:
    """N fake replicas serving HTTP; their registry records are written as a scheduler would."""

    def __init__(self, redis_url: str, names: list[str], capacity: int = 8, signer=None, model: str = MODEL,
                 tokenizer=None):
        """`tokenizer`: a ModelTokenizer whose bundle they publish, as a scheduler does (None: none)."""
        self.redis_url = redis_url
        self.model = model
        self.tokenizer = tokenizer
        self.adapters: dict[str, dict[str, str]] = {n: {} for n in names}  # replica -> resident adapters
        self.adapter_load_seconds: dict[str, float] = {}
        self.signer = signer  # the internal token their records are signed with, if any
        self.seen: dict[str, list] = {n: [] for n in names}
        self.headers: list[dict] = []  # of every request any of them got, in arrival order
        self.apps = {n: replica_app(n, self.seen[n], self.headers) for n in names}
        self.servers = {n: AppServer(self.apps[n]) for n in names}
        self.capacity = capacity
        self.sink = RedisSink(None, signer=signer)  # one writer: it remembers each replica's index generation
        self.loads: dict[str, ReplicaLoad] = {}
        self.urls: dict[str, str | None] = {}

    def __enter__(self) -> FakeReplicas:
        for s in self.servers.values():
            s.__enter__()
        for n in self.servers:
            self.publish(n, ReplicaLoad())
        return self

    def __exit__(self, *exc) -> None:
        for s in self.servers.values():
            s.__exit__()

    def info(self, name: str, url: str | None = None) -> ReplicaInfo:
        return ReplicaInfo(replica_id=name, url=url or self.servers[name].url, model=self.model, block_size=BLOCK,
                           max_model_len=2048, capacity=self.capacity, hash_seed=model_hash_seed(self.model, BLOCK),
                           adapters=dict(self.adapters[name]),
                           tokenizer_digest=self.tokenizer.digest if self.tokenizer is not None else "",
                           adapter_load_seconds=self.adapter_load_seconds.get(name, 0.0))

    def _run(self, fn) -> None:
        async def go():
            self.sink.client = connect(self.redis_url)  # a client per event loop
            try:
                await fn(self.sink)
            finally:
                await self.sink.client.aclose()

        asyncio.run(go())

    def publish(self, name: str, load: ReplicaLoad, url: str | None = None) -> None:
        self.loads[name], self.urls[name] = load, url

        async def write(sink):
            if self.tokenizer is not None:
                await sink.write_tokenizer(self.tokenizer.digest, self.tokenizer.bundle)
            await sink.write_state(ReplicaState(self.info(name, url), load), ttl=60)

        self._run(write)

    def store_blocks(self, name: str, hashes: list[int]) -> None:
        """Blocks stored, then the record again (it names the generation they are filed under)."""
        async def write(sink):
            await sink.write_blocks(name, BlockDelta(stored=set(hashes)), ttl=60)
            await sink.write_state(ReplicaState(self.info(name, self.urls.get(name)), self.loads[name]), ttl=60)

        self._run(write)

    def remove(self, name: str) -> None:
        """The replica leaves the registry (stopped, or its record expired)."""
        async def drop(sink):
            await sink.remove_replica(name)

        self._run(drop)

    def who(self) -> dict[str, int]:
        return {n: len(v) for n, v in self.seen.items()}
