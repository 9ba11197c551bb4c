"""The Responses API request (`POST /v1/responses`), and its translation into a chat request.

Stateless: nothing is stored, so `store: true` and `previous_response_id` are refused by name, and the
conversation travels in `input` (a string, or messages and the function calls and outputs of earlier
turns, as the official client and agent frameworks send them back). Everything else maps onto the chat
request this server already serves: instructions become a system message, function tools chat tools,
`text.format` a response_format, `max_output_tokens` max_completion_tokens. The router and the replica
both translate (services.openai_api.prompts then renders it), and errors found in the translated request
are reported under the Responses field that caused them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from services.openai_api.body import _refuse, reject_unsupported, validated
from services.openai_api.errors import APIError, validation_error
from services.openai_api.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionName,
    MaxTokens,
    Name,
    Temperature,
    TokenId,
    TopLogprobs,
    TopP,
    _Strict,
)
from services.request.limits import INT64_MAX

_Text = Annotated[str, Field(max_length=4 * 1024 * 1024)]
_Id = Annotated[str, Field(min_length=1, max_length=256)]


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: _Text
    annotations: list[Any] | None = None  # echoed back from earlier output; ignored
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _Text | Annotated[list[InputText], Field(max_length=MAX_MESSAGES)]
    id: _Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Name | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: _Id
    name: FunctionName
    arguments: _Text
    id: _Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: _Id
    output: _Text | Annotated[list[InputText], Field(max_length=MAX_MESSAGES)]
    id: _Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=64 * 1024)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: Name
    input: _Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: _Text | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: Name | None = None
    # Accepted at their inert values (see `to_chat`): what the official client and agent SDKs send.
    metadata: dict[Name, Annotated[str, Field(max_length=512)]] | None = None
    user: Name | None = None
    include: Annotated[list[Name], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: Name | None = None
    background: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    top_logprobs: TopLogprobs | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None
    stream_options: dict[str, bool] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's, as on chat
    # Internal: the prompt the router already tokenized, as for chat.
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None


def parse_responses_request(body: dict) -> ResponsesRequest:
    req = validated(ResponsesRequest, body)
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise _refuse("previous_response_id", "previous_response_id (responses are not stored; send the "
                      "conversation in input)")
    if req.store:
        raise _refuse("store", "storing responses")
    if req.background:
        raise _refuse("background", "background responses")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise _refuse("reasoning", "reasoning options")
    if req.include:
        raise _refuse("include", f"include {req.include[0]!r}")
    if req.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "max_tool_calls")
    if req.top_logprobs:
        raise _refuse("top_logprobs", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")


def _part_text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def to_chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request this response is generated as, and the Responses field each of its messages came
    from (for `responses_error`); APIErrors name the Responses fields."""
    messages: list[dict] = []
    where: list[str] = []  # the input path each chat message came from
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        where.append("instructions")
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        path = "input" if isinstance(req.input, str) else f"input.{i}"
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _part_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and where[-1].startswith("input"):
                messages[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _part_text(item.output)})
        where.append(path)
    body: dict = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "metadata", "service_tier", "cache_salt"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in (
                ("name", fmt.name or "response"), ("schema", fmt.json_schema), ("strict", fmt.strict),
                ("description", fmt.description)) if v is not None}}
    if req.prompt_token_ids is not None:
        body["prompt_token_ids"] = req.prompt_token_ids
    try:
        chat = ChatCompletionRequest.model_validate(body)
        reject_unsupported(chat)
    except (ValidationError, APIError) as exc:
        raise responses_error(exc if isinstance(exc, APIError) else validation_error(exc), where) from None
    return chat, where


_FIELDS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
# Chat nests a function under "function"; Responses does not (tools.0.function.parameters -> tools.0.parameters).
_TAILS = {"tool_call_id": "call_id", "content": "content"}


def responses_error(err: APIError, where: list[str]) -> APIError:
    """A chat request's error, renamed to the Responses field it came from (messages.3 -> input.2)."""
    param = err.param
    if param is None:
        return err
    head, _, rest = param.partition(".")
    if head == "messages":
        index, _, tail = rest.partition(".")
        origin = where[int(index)] if index.isdigit() and int(index) < len(where) else "input"
        tail = _TAILS.get(tail.split(".")[0], tail) if tail else ""
        new = origin + ("." + tail if tail and origin not in ("instructions", "input") else "")
    else:
        rest = rest.replace("function.", "", 1) if head in ("tools", "tool_choice") else rest
        rest = rest.replace("json_schema.", "", 1) if head == "response_format" else rest
        new = _FIELDS.get(head, head) + ("." + rest if rest else "")
    message = err.message.replace(param, new, 1) if err.message.startswith(param) else err.message
    return APIError(err.status, message, new, err.code, err.headers)
