"""OpenAI request bodies: parsed strictly (a string where a number belongs is a 400, not a coercion).

Shared by the router (which validates before it routes) and the scheduler (which validates again:
it may be reached directly). Unknown fields are ignored, as OpenAI's own clients send extras.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from services.openai_api.errors import APIError, validation_error

Number = StrictInt | StrictFloat
TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # vLLM extension
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    user: StrictStr | None = None
    # Internal: the prompt the router already tokenized (chat template applied), so it is done once.
    prompt_token_ids: TokenIds | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_dict(self) -> dict:
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        # Chat templates know "system", not OpenAI's newer "developer" role.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


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
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def parse_request(model_cls: type[_SamplingFields], body: dict) -> _SamplingFields:
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _reject_unsupported(req)
    return req


def _reject_unsupported(req: _SamplingFields) -> None:
    """Fields we parse but cannot honour: a clear 400 beats silently ignoring them."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise APIError(400, f"{name} is not supported by this server", name)
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if isinstance(req.prompt, list) and len(req.prompt) == 0:
            raise APIError(400, "prompt must not be empty", "prompt")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
