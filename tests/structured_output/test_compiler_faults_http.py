"""A fault of the grammar compiler that is the server's (here: the tokenizer's llguidance view cannot be
built) reaches an HTTP client as a 5xx error object through the error handlers the router and every
replica install (services.openai_api.errors), is logged once, and is not remembered: the same request
succeeds once the fault is gone. A constraint that cannot compile stays a 400 naming the field."""

from __future__ import annotations

import logging

import httpx
from fastapi import FastAPI, Request

from services.openai_api.errors import install_error_handlers
from services.request.structured_outputs import StructuredOutputsParams
from services.structured_output.compiler import GrammarCompiler, GrammarServiceError
from tests.conftest import AppServer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_a_compiler_fault_is_a_logged_5xx_and_is_not_cached(smol_tokenizer, caplog):
    broken = {"on": True}

    def tokenizer_json() -> str:
        if broken["on"]:
            raise MemoryError("cannot allocate the tokenizer's trie")
        return smol_tokenizer.fast.to_str()

    grammars = GrammarCompiler(tokenizer_json, smol_tokenizer.vocab_size)
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/compile")
    async def compile_route(request: Request) -> dict:  # what a replica and the router do before queueing
        body = await request.json()
        await grammars.compile_async(StructuredOutputsParams(**body, source="structured_outputs"))
        return {"ok": True}

    try:
        with AppServer(app) as server, caplog.at_level(logging.WARNING):
            r = httpx.post(f"{server.url}/compile", json={"json": SCHEMA}, timeout=30)
            assert r.status_code >= 500, r.text
            assert r.json()["error"]["type"] == "server_error"
            faults = [rec for rec in caplog.records if rec.exc_info and rec.exc_info[0] is GrammarServiceError]
            assert len(faults) == 1 and len(caplog.records) == 1, [rec.getMessage() for rec in caplog.records]
            assert "MemoryError" in str(faults[0].exc_info[1])
            broken["on"] = False
            r = httpx.post(f"{server.url}/compile", json={"json": SCHEMA}, timeout=30)
            assert r.status_code == 200, r.text  # the fault was not cached against the schema
            r = httpx.post(f"{server.url}/compile", json={"grammar": "start: %%% not lark"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
            assert grammars.stats.server_faults == 1 and grammars.stats.failures == 1
    finally:
        grammars.close()
