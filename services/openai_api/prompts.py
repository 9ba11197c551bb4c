"""From a parsed OpenAI request to what the engine takes: prompt token ids and SamplingParams.

The router and the scheduler both run this, so both apply the same chat template, the same defaults
and the same context-length rule; a request the router accepts is one the scheduler accepts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from services.model_files.tokenizer import NoChatTemplateError
from services.openai_api.errors import APIError
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.structured import structured_outputs_of
from services.openai_api.tool_grammar import tool_constraint
from services.openai_api.tool_prompt import CALL_CLOSE, ToolUse, template_messages, tool_use
from services.request.errors import InvalidRequestError
from services.request.limits import vocabulary_faults
from services.request.sampling_params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
INLINE_TOKENIZE_CHARS = 20_000  # longer texts are tokenized in a worker thread


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class PreparedRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompts: list[list[int]]  # one token list per prompt (completions accept several)
    params: SamplingParams
    stream: bool
    include_usage: bool
    tools: ToolUse | None = None  # the calls the model may make (chat with tools offered)
    echo: list[str] | None = None  # completions with echo: each prompt's text, which its choices begin with


def prompt_token_lists(req: CompletionRequest | ChatCompletionRequest,
                       tokenizer: TokenizerLike) -> list[list[int]]:
    if req.prompt_token_ids is not None:
        prompts = [list(req.prompt_token_ids)]
    elif isinstance(req, ChatCompletionRequest):
        messages, tools = template_messages(req, tokenizer)
        kw = {"tools": tools} if tools else {}
        if req.chat_template_kwargs:
            kw["template_kwargs"] = req.chat_template_kwargs
        try:
            prompts = [tokenizer.apply_chat_template(messages, **kw)]
        except Exception as exc:  # the template's own raise_exception(), e.g. roles out of order
            raise _template_error(exc) from None
    elif isinstance(req.prompt, str):
        prompts = [tokenizer.encode(req.prompt)]
    elif req.prompt and isinstance(req.prompt[0], str):
        prompts = [tokenizer.encode(p) for p in req.prompt]
    elif req.prompt and isinstance(req.prompt[0], int):
        prompts = [list(req.prompt)]
    else:
        prompts = [list(p) for p in req.prompt]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", _prompt_field(req))
    vocab = tokenizer.vocab_size
    for p in prompts:
        if max(p) >= vocab:
            field = "prompt_token_ids" if req.prompt_token_ids is not None else _prompt_field(req)
            raise APIError(400, f"{field}: token id {max(p)} is outside the vocabulary [0, {vocab})", field)
    return prompts


def _template_error(exc: Exception) -> APIError:
    """A 400 naming what the template refused: the messages, chat_template_kwargs, or chat as a whole."""
    if isinstance(exc, NoChatTemplateError):
        return APIError(400, str(exc), "messages", "chat_template_missing")
    if str(exc).startswith("chat_template_kwargs"):
        return APIError(400, str(exc), "chat_template_kwargs")
    return APIError(400, f"messages cannot be rendered with the model's chat template: {exc}", "messages")


def chat_prompt_ids(messages, tokenizer: TokenizerLike, add_generation_prompt: bool = True) -> list[int]:
    """Chat messages through the model's template, or a 400 naming `messages` when it refuses them."""
    try:
        return tokenizer.apply_chat_template([m.as_template_dict() for m in messages], add_generation_prompt)
    except Exception as exc:  # the template's own raise_exception(), e.g. roles out of order
        raise _template_error(exc) from None


def logit_bias_ids(req) -> dict[int, float] | None:
    """OpenAI's logit_bias (decimal token id strings) with int keys; a 400 naming it for any other key."""
    if not req.logit_bias:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        # Canonical decimals only: "7" and "07" would otherwise both name token 7.
        if not key.isascii() or not key.isdigit() or (len(key) > 1 and key[0] == "0"):
            raise APIError(400, f"logit_bias: keys must be token ids as decimal strings, got {key[:20]!r}",
                           "logit_bias")
        out[int(key)] = bias
    return out


def _check_vocab_fields(req, vocab: int) -> None:
    """The vocabulary rules the scheduler applies too (services.request.limits.vocabulary_faults)."""
    faults = vocabulary_faults(vocab, -1 if req.top_k is None else req.top_k, req.stop_token_ids,
                               logit_bias_ids(req))
    if faults:
        raise APIError.from_invalid(InvalidRequestError(*faults[0]))


def sampling_params(req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                    max_model_len: int) -> SamplingParams:
    """SamplingParams with OpenAI's defaults; raises APIError (400) naming the bad field."""
    check_context_length(prompt_len, None, max_model_len, _prompt_field(req), "max_tokens")
    is_chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_tokens
    max_tokens_field = "max_tokens"
    if is_chat and req.max_completion_tokens is not None:
        max_tokens, max_tokens_field = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len if is_chat else COMPLETION_DEFAULT_MAX_TOKENS
        max_tokens = min(max_tokens, max_model_len - prompt_len)
    logprobs = req.logprobs
    if is_chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        default_temperature = 0.0 if req.use_beam_search else 1.0
        params = SamplingParams(
            n=req.n, temperature=default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, cache_salt=req.cache_salt,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias_ids(req), min_p=req.min_p or 0.0,
            best_of=None if is_chat else req.best_of,
            use_beam_search=req.use_beam_search, length_penalty=req.length_penalty,
            early_stopping=req.early_stopping, structured_outputs=structured_outputs_of(req))
    except InvalidRequestError as exc:
        name = max_tokens_field if exc.field == "max_tokens" else exc.field
        if is_chat and exc.field == "logprobs":
            name = "top_logprobs"
        raise APIError(400, f"{name}: {exc.message}", name) from None
    check_context_length(prompt_len, max_tokens, max_model_len, _prompt_field(req), max_tokens_field)
    return params


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_field: str,
                         max_tokens_field: str) -> None:
    """OpenAI's rule (and vLLM's server's): prompt and completion must fit the context, else a 400."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.", prompt_field,
                       "context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                       f"in the completion). Please reduce the length of the prompt or completion.",
                       max_tokens_field, "context_length_exceeded")


def prepare(req: CompletionRequest | ChatCompletionRequest, tokenizer: TokenizerLike,
            max_model_len: int) -> PreparedRequest:
    tools = tool_use(req) if isinstance(req, ChatCompletionRequest) else None
    prompts = prompt_token_lists(req, tokenizer)
    _check_vocab_fields(req, tokenizer.vocab_size)
    params = sampling_params(req, max(len(p) for p in prompts), max_model_len)
    if isinstance(req, ChatCompletionRequest) and tools is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"{params.structured_outputs.field_name}: cannot constrain the output while tools "
                           "may be called (their calls are constrained); use tool_choice \"none\" with it",
                           params.structured_outputs.field_name)
        try:
            params.structured_outputs = tool_constraint(tools)
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc) from None
        if not tools.parallel and CALL_CLOSE not in params.stop_strings:
            # One call, then the end: the call's closing tag stops generation (the parser needs no tag).
            params.stop_strings.append(CALL_CLOSE)
    if isinstance(req, ChatCompletionRequest):
        return PreparedRequest("chat", req.model, prompts, params, req.stream, req.include_usage, tools)
    echo = _echo_texts(req, prompts, tokenizer) if req.echo else None
    return PreparedRequest("completion", req.model, prompts, params, req.stream, req.include_usage, echo=echo)


def _echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer) -> list[str]:
    """The prompt as the client sent it when it was text, else its tokens decoded (as vLLM echoes)."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if req.prompt and isinstance(req.prompt[0], str):
        return list(req.prompt)
    return [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


async def prepare_async(req: CompletionRequest | ChatCompletionRequest, tokenizer: TokenizerLike,
                        max_model_len: int) -> PreparedRequest:
    """`prepare`, moved off the event loop for long texts so one huge prompt does not stall other streams."""
    if _text_size(req) > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(prepare, req, tokenizer, max_model_len)
    return prepare(req, tokenizer, max_model_len)


def _text_size(req) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else 0 for m in req.messages)
    if isinstance(req.prompt, str):
        return len(req.prompt)
    return sum(len(p) for p in req.prompt if isinstance(p, str))


def _prompt_field(req) -> str:
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
