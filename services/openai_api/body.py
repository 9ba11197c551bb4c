"""From raw request bytes to a validated OpenAI request, or a 4xx naming what is wrong.

Everything a hostile body can do to a JSON parser is answered here: oversized bodies (413, refused
before they are read whole), invalid UTF-8, nesting deep enough to exhaust the parser's recursion,
integers of thousands of digits, lone surrogates (valid JSON, but no tokenizer, hash or encoder can
take them). Then the schema (services.openai_api.protocol), then fields this server cannot honour.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.openai_api.errors import APIError, validation_error
from services.openai_api.protocol import MAX_SEQUENCES, ChatCompletionRequest, CompletionRequest, _SamplingFields

# A JSON escape of a UTF-16 surrogate. Paired ones decode to one character; a lone one survives into
# the parsed string, which is what `_find_surrogate` then looks for (only when the raw body has one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object, refusing oversized bodies without reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def parse_json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        where = _find_surrogate(body, "")
        if where is not None:
            raise APIError(400, f"{where or 'body'}: contains a lone UTF-16 surrogate, which is not text",
                           where or None)
    return body


def _find_surrogate(value, path: str) -> str | None:
    """Path of the first string (or key) holding an unpaired surrogate, else None."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{p}.{k}" if p else str(k)
                if not _encodable(k):
                    return p or "body"
                stack.append((item, sub))
        elif isinstance(v, list):
            stack.extend((item, f"{p}.{i}") for i, item in enumerate(v) if isinstance(item, (str, list, dict)))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validated(model_cls: type[BaseModel], body: dict) -> BaseModel:
    """`body` as a `model_cls`, or a 400 naming the field pydantic found wrong."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_request(model_cls: type[_SamplingFields], body: dict) -> _SamplingFields:
    req = validated(model_cls, body)
    reject_unsupported(req)
    return req


def _refuse(field: str, what: str) -> APIError:
    return APIError(400, f"{field}: {what} is not supported by this server", field, "unsupported_parameter")


def reject_unsupported(req: _SamplingFields) -> None:
    """Fields we parse but cannot honour, unless at their inert value: a 400 beats silently ignoring them."""
    if req.store:
        raise _refuse("store", "storing completions")
    if req.service_tier not in (None, "auto", "default"):
        raise _refuse("service_tier", f"service tier {req.service_tier!r}")
    if req.use_beam_search and req.stream:
        raise _refuse("stream", "streaming beam search (the best beams are known only at the end)")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.echo and req.logprobs is not None:
            raise _refuse("echo", "echo with logprobs (log-probabilities of the prompt)")
        if req.suffix:
            raise _refuse("suffix", "suffix")
        _check_best_of(req)
    if isinstance(req, ChatCompletionRequest):
        _reject_unsupported_chat(req)


def _check_best_of(req: CompletionRequest) -> None:
    n = req.n if req.best_of is None else req.best_of
    if req.best_of is not None and req.best_of < req.n:
        raise APIError(400, f"best_of: must be >= n ({req.n}), got {req.best_of}", "best_of")
    if req.best_of is not None and req.best_of > req.n and req.stream:
        # OpenAI's rule: the best cannot be known until every sample is done.
        raise APIError(400, "best_of: results cannot be streamed when best_of > n", "best_of")
    prompts = len(req.prompt) if isinstance(req.prompt, list) and req.prompt and not isinstance(
        req.prompt[0], int) else 1
    if prompts * n > MAX_SEQUENCES:
        what = "n" if req.best_of is None else "best_of"
        raise APIError(400, f"prompt: {prompts} prompts x {what}={n} is {prompts * n} sequences; at most "
                       f"{MAX_SEQUENCES} per request", "prompt")


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    # The deprecated `functions` API: `tools` does the same and is served (services.openai_api.tool_prompt).
    if req.functions:
        raise _refuse("functions", "the deprecated functions API (use tools)")
    if req.function_call not in (None, "none", "auto"):
        raise _refuse("function_call", "the deprecated function_call (use tool_choice)")
    if req.modalities not in (None, ["text"]):
        raise _refuse("modalities", "output other than text")
    for name in ("audio", "prediction", "web_search_options", "reasoning_effort"):
        if getattr(req, name) is not None:
            raise _refuse(name, name)
