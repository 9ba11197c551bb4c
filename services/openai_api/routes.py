"""The endpoints the router and a replica share, and the app they are mounted on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.openai_api.errors import APIError, install_error_handlers
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.responses_protocol import ResponsesRequest


def models_body(models: list[tuple], created: int = 0) -> dict:
    """`/v1/models` for (served name, max model length[, parent[, model path]]) tuples: a LoRA adapter names
    the base model it runs on as its `parent` (vLLM's convention); a base model's parent is null. The model
    path says how the engine runs it: "pagedserve" (its own module) or "transformers" (transformers' class)."""
    return {"object": "list", "data": [{"id": m[0], "object": "model", "created": created,
                                        "owned_by": "pagedserve", "root": m[0], "parent": m[2] if len(m) > 2 else None,
                                        "max_model_len": m[1], **({"model_path": m[3]} if len(m) > 3 else {})}
                                       for m in models]}


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")


def bare_app(lifespan=None) -> FastAPI:
    """A FastAPI app with OpenAI-style errors for everything and its schema at /openapi.json (no docs UI)."""
    app = FastAPI(title="pagedserve", version=_version(), docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0"


_REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                   "/v1/responses": ResponsesRequest}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document of the routes, with the request bodies our handlers parse themselves (they take
    the raw request, so FastAPI cannot see them): every field, its type and its range."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _REQUEST_MODELS.items():
            op = doc.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
    return app.openapi_schema


def add_openai_routes(app: FastAPI, handler, models: Callable[[Request], Awaitable[dict]],
                      render_metrics: Callable[[], tuple[bytes, str]],
                      responses: Callable[[Request], Awaitable[Response]] | None = None) -> None:
    """`handler` has async completions(request), chat(request), tokenize(request), detokenize(request) and,
    unless `responses` is given, responses(request)."""
    app.add_api_route("/v1/completions", handler.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handler.chat, methods=["POST"])
    app.add_api_route("/v1/responses", responses or handler.responses, methods=["POST"])
    # vLLM's paths (no /v1 prefix).
    app.add_api_route("/tokenize", handler.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", handler.detokenize, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])

    async def metrics_route() -> Response:
        data, content_type = render_metrics()
        return Response(data, media_type=content_type)

    app.add_api_route("/metrics", metrics_route, methods=["GET"])
