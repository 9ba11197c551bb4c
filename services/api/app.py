"""The HTTP app of one model replica: OpenAI endpoints, /health and /metrics.

Used by the scheduler service and, behind the in-process router, by `pagedserve serve`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.api.errors import install_error_handlers
from services.api.metrics import SchedulerMetrics
from services.api.serving import OpenAIServing


def models_body(model_name: str, max_model_len: int, created: int = 0) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "pagedserve", "max_model_len": max_model_len}]}


def bare_app(lifespan=None) -> FastAPI:
    """A FastAPI app without docs routes and with OpenAI-style errors for everything."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_error_handlers(app)
    return app


def add_openai_routes(app: FastAPI, handler, models: Callable[[Request], Awaitable[dict]],
                      render_metrics: Callable[[], tuple[bytes, str]]) -> None:
    """The endpoints the router and a replica share; `handler` has async completions(request), chat(request)."""
    app.add_api_route("/v1/completions", handler.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handler.chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])

    async def metrics_route() -> Response:
        data, content_type = render_metrics()
        return Response(data, media_type=content_type)

    app.add_api_route("/metrics", metrics_route, methods=["GET"])


def create_replica_app(serving: OpenAIServing, metrics: SchedulerMetrics,
                       health: Callable[[], dict]) -> FastAPI:
    """`health()` returns a dict with at least "healthy": bool (false -> 503, so probes and routers see it)."""
    app = bare_app()
    cfg = serving.config

    async def models(request: Request) -> dict:
        return models_body(cfg.model_name, cfg.max_model_len)

    add_openai_routes(app, serving, models, metrics.render)

    @app.get("/health")
    async def health_route() -> Response:
        status = health()
        return JSONResponse(status, status_code=200 if status.get("healthy") else 503)

    return app
