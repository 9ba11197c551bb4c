"""vLLM's `/tokenize` and `/detokenize`: a prompt or chat (through the model's template) to token ids,
and token ids back to text. The router answers them itself with the tokenizer it routes with (the
replicas'), so they cost no replica anything; a replica answers them the same way."""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import Field, ValidationError

from services.openai_api.errors import APIError, validation_error
from services.openai_api.prompts import INLINE_TOKENIZE_CHARS, TokenizerLike, chat_prompt_ids
from services.openai_api.protocol import MAX_MESSAGES, ChatMessage, Name, TokenId, _Strict

MAX_DETOKENIZE_TOKENS = 1024 * 1024


class TokenizeCompletionRequest(_Strict):
    model: Name | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: Name | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


def parse_tokenize(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM tells the two forms apart by `messages`."""
    cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_detokenize(body: dict) -> DetokenizeRequest:
    try:
        return DetokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _token_ids(req: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer) -> list[int]:
    if isinstance(req, TokenizeChatRequest):
        for i, m in enumerate(req.messages):
            if m.tool_calls or m.tool_call_id:
                raise APIError(400, f"messages.{i}: tool messages are not supported by /tokenize",
                               f"messages.{i}")
        return chat_prompt_ids(req.messages, tokenizer, req.add_generation_prompt)
    return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)


async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: TokenizerLike,
                   max_model_len: int) -> dict:
    """vLLM's response: count, max_model_len, tokens, and token_strs when asked (else null)."""
    size = len(req.prompt) if isinstance(req, TokenizeCompletionRequest) else sum(
        len(m.content) if isinstance(m.content, str) else 0 for m in req.messages)
    if size > INLINE_TOKENIZE_CHARS:  # long texts off the event loop, as prepare_async does
        ids = await asyncio.to_thread(_token_ids, req, tokenizer)
    else:
        ids = _token_ids(req, tokenizer)
    strs = tokenizer.token_strings(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: TokenizerLike) -> dict:
    vocab = tokenizer.vocab_size
    for i, t in enumerate(req.tokens):
        if t >= vocab:
            raise APIError(400, f"tokens: entry {i} = {t} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
