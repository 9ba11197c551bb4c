"""OpenAI-style error objects, and the handlers that make every failure of a request one of them.

Clients (the `openai` package included) expect `{"error": {"message", "type", "param", "code"}}` with a
meaningful status. Bad input is a 4xx naming the offending field; only our own bugs are a 500, and
those are logged once with the request's path.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.request.errors import InvalidRequestError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 502: "server_error",
          503: "service_unavailable", 504: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_invalid(cls, exc: InvalidRequestError) -> APIError:
        return cls(400, exc.message if exc.field in exc.message else f"{exc.field}: {exc.message}", exc.field)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def validation_error(exc: RequestValidationError | Exception) -> APIError:
    """Pydantic's most specific complaint, as a 400 naming the field (e.g. `messages.0.content`).

    A union field (a prompt is text, texts, ids or lists of ids) gets one error per member; the member
    the value came closest to (deepest, and of the right type but a bad value) is the one worth reporting.
    """
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, str(exc))
    first = max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union members appear in the path by type name ("prompt.str", "prompt.list[int]"): drop those.
    loc = [p for p in loc if not any(c in p for c in "[]-") and p not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        msg = "unknown field; this server does not accept it"
    else:
        msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError):
        return APIError.from_invalid(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response()
