"""OpenAI request bodies with the range of every field: parsed strictly, nothing coerced, nothing unknown.

Shared by the router (which validates before it routes) and the scheduler (which validates again: it
may be reached directly). Every number has a range, so nothing a client sends can overflow a hash, a
msgpack frame or a sampler; lists have lengths, so one request cannot queue unbounded work. Fields
OpenAI defines that this server cannot honour are refused by name (services.openai_api.body), and
unknown fields are refused too: a client asking for something must never silently get something else.
The same models generate `/openapi.json`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.request import limits as L
from services.request.limits import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_PROMPTS = 1024  # prompts in one completions request (vLLM's limit)
MAX_SEQUENCES = 1024  # n x prompts: sequences one request may queue
MAX_MESSAGES = 4096
MAX_NAME_CHARS = 256  # model, user, cache_salt, message names
MAX_TOOLS = 128  # OpenAI's limit on functions per request
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history



def ranged(kind: type, bound: L.Range):
    """A field type with the bound of services.request.limits (the one table every process reads)."""
    return Annotated[kind, Field(**bound.pydantic())]


TokenId = ranged(int, L.TOKEN_ID)
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=4 * 1024 * 1024)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=L.MAX_STOP_CHARS)]
MaxTokens = ranged(int, L.MAX_TOKENS)
Temperature = ranged(float, L.TEMPERATURE)
TopP = ranged(float, L.TOP_P)
TopLogprobs = ranged(int, L.LOGPROBS)


class _Strict(BaseModel):
    # strict: "1" is not a number and 1.0 not an integer; forbid: unknown fields are a 400 naming them.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """response_format.json_schema (OpenAI): the schema under `schema`, strict mode under `strict`."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingFields(_Strict):
    model: Name
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: ranged(int, L.TOP_K) | None = None  # vLLM extension; -1 or 0: off
    n: ranged(int, L.N) = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    seed: ranged(int, L.SEED) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: ranged(int, L.MIN_TOKENS) = 0  # vLLM extension
    presence_penalty: ranged(float, L.PENALTY) | None = None  # OpenAI: over the tokens generated so far
    frequency_penalty: ranged(float, L.PENALTY) | None = None
    repetition_penalty: ranged(float, L.REPETITION_PENALTY) | None = None  # vLLM's
    # Token id (a decimal string, OpenAI's form) -> bias added to its logit.
    logit_bias: Annotated[dict[Annotated[str, Field(max_length=12)], ranged(float, L.LOGIT_BIAS)],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_p: ranged(float, L.MIN_P) | None = None  # vLLM extension
    user: Name | None = None
    # Prefix-cache isolation (vLLM's field): blocks of different salts never match.
    cache_salt: Annotated[str, Field(min_length=1, max_length=L.MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's beam-search extension: n beams, the n best returned (scored as transformers' generate does).
    use_beam_search: bool = False
    length_penalty: ranged(float, L.LENGTH_PENALTY) = 1.0
    early_stopping: bool | Literal["never"] = False
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    # (at most one of them; services.openai_api.structured reads them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI fields with no effect here, accepted at their inert values only (body.reject_unsupported).
    metadata: dict[Name, Annotated[str, Field(max_length=512)]] | None = None
    store: bool | None = None
    service_tier: Name | None = None
    # Internal: the prompt the router already tokenized (chat template applied), so it is done once.
    prompt_token_ids: TokenIds | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: TopLogprobs | None = None
    echo: bool = False  # the prompt's text before each choice's
    suffix: str | None = None
    best_of: ranged(int, L.BEST_OF) | None = None  # >= n; the n of highest cumulative logprob


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names; it also keeps names safe to quote inside a grammar.
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]


class FunctionCallParam(_Strict):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=1024 * 1024)]  # JSON text, as the model wrote it


class ToolCallParam(_Strict):
    """A call an assistant message of the history made (services.openai_api.tool_prompt renders it)."""
    id: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_template_dict(self) -> dict:
        # Chat templates know "system", not OpenAI's newer "developer" role.
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Annotated[str, Field(max_length=64 * 1024)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; checked when its grammar is built
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: Annotated[list[Name], Field(max_length=8)] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Name | None = None
    # Extra chat-template variables (vLLM's field), e.g. {"enable_thinking": false} for Qwen3's template.
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None
    web_search_options: dict[str, Any] | None = None
