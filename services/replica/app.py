"""The HTTP app of one model replica: OpenAI endpoints, /health and /metrics.

Used by the scheduler service and, behind the in-process router, by `pagedserve serve`.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.openai_api.routes import add_openai_routes, bare_app, models_body
from services.replica.lora_admin import LoraAdmin
from services.replica.metrics import SchedulerMetrics
from services.replica.openai_serving import OpenAIServing
from services.replica.responses_endpoint import ResponsesEndpoint


def create_replica_app(serving: OpenAIServing, metrics: SchedulerMetrics,
                       health: Callable[[], dict], lora_admin: LoraAdmin | None = None) -> FastAPI:
    """`health()` returns a dict with at least "healthy": bool (false -> 503, so probes and routers see it)."""
    app = bare_app()
    cfg = serving.config

    async def models(request: Request) -> dict:
        serving.check_caller(request)
        body = models_body([(cfg.model_name, cfg.max_model_len, None, cfg.model_path)])
        # vLLM's form: each adapter is a model whose parent is the base model.
        body["data"] += [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve",
                          "max_model_len": cfg.max_model_len, "parent": cfg.model_name, "root": ref.path}
                         for name, ref in list(serving.adapters.items())]
        return body

    add_openai_routes(app, serving, models, metrics.render, responses=ResponsesEndpoint(serving).responses)
    if lora_admin is not None:
        app.add_api_route("/v1/load_lora_adapter", lora_admin.load, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", lora_admin.unload, methods=["POST"])

    @app.get("/health")
    async def health_route() -> Response:
        status = health()
        return JSONResponse(status, status_code=200 if status.get("healthy") else 503)

    return app
