"""The endpoints the router and a replica share, and the app they are mounted on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.openai_api.errors import APIError, install_error_handlers


def models_body(models: list[tuple[str, int]], created: int = 0) -> dict:
    """`/v1/models` for (served name, max model length) pairs."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "pagedserve", "max_model_len": max_len}
                                       for name, max_len in models]}


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")


def bare_app(lifespan=None) -> FastAPI:
    """A FastAPI app without docs routes and with OpenAI-style errors for everything."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_error_handlers(app)
    return app


def add_openai_routes(app: FastAPI, handler, models: Callable[[Request], Awaitable[dict]],
                      render_metrics: Callable[[], tuple[bytes, str]]) -> None:
    """`handler` has async completions(request) and chat(request)."""
    app.add_api_route("/v1/completions", handler.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handler.chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])

    async def metrics_route() -> Response:
        data, content_type = render_metrics()
        return Response(data, media_type=content_type)

    app.add_api_route("/metrics", metrics_route, methods=["GET"])
