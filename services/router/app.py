"""The router's HTTP app: the public OpenAI endpoint, /health and /metrics."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.openai_api.routes import add_openai_routes, bare_app, models_body
from services.router.service import RouterService


def create_router_app(service: RouterService,
                      render_metrics: Callable[[], tuple[bytes, str]] | None = None) -> FastAPI:
    """`render_metrics` replaces the router's own /metrics (`serve` adds its replica's metrics)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await service.close()

    app = bare_app(lifespan)

    async def models(request: Request) -> dict:
        service.keys.check(request.headers.get("authorization"))
        return models_body(await service.view.models())

    add_openai_routes(app, service, models, render_metrics or service.metrics.render)

    @app.get("/health")
    async def health() -> Response:
        # The router itself is healthy without replicas (it answers 503s clearly); report them for humans.
        replicas = await service.view.snapshot([])
        return JSONResponse({"healthy": True, "replicas": sorted(r.info.replica_id for r in replicas),
                             "queue_depth": service.admission.waiting, "held": service.admission.held})

    return app
