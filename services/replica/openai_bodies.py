"""OpenAI response objects: whole completions, streamed chunks, usage and log-probabilities.

Pure functions of engine outputs, so the formats can be checked without a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.contracts.step_protocol import TokenLogprobs

TokenText = Callable[[int], str]  # token id -> its text, for log-probabilities

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[TokenLogprobs], token_ids: list[int], text: TokenText,
                        offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    tokens = [text(t) for t in token_ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in zip(e.top_ids, e.top_logprobs, strict=False)} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs], token_ids: list[int], text: TokenText) -> dict:
    def item(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    content = []
    for tid, e in zip(token_ids, entries, strict=False):
        entry = item(text(tid), e.logprob)
        entry["top_logprobs"] = [item(text(i), lp) for i, lp in zip(e.top_ids, e.top_logprobs, strict=False)]
        content.append(entry)
    return {"content": content}


def choice(kind: str, index: int, text_delta: str, reason: str | None, logprobs: dict | None,
           first: bool = False, stream: bool = False, tool_calls: list[dict] | None = None) -> dict:
    """One choice of a response or a stream chunk. `tool_calls` (chat): whole calls in a response, one
    call's delta in a chunk; a message with calls and no text has content null, as OpenAI's."""
    if kind == "completion":
        return {"index": index, "text": text_delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    if stream:
        delta: dict = {"role": "assistant", "content": text_delta} if first else {"content": text_delta}
        if tool_calls:
            if not text_delta:
                delta["content"] = None
                if not first:
                    del delta["content"]
            delta["tool_calls"] = tool_calls
        elif not text_delta and not first:
            delta = {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    message: dict = {"role": "assistant", "content": text_delta}
    if tool_calls:
        message["content"] = text_delta or None
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def envelope(kind: str, request_id: str, model: str, created: int, choices: list[dict], stream: bool,
             usage_obj: dict | None = None, with_usage_field: bool = False) -> dict:
    if kind == "completion":
        obj = "text_completion"
    else:
        obj = "chat.completion.chunk" if stream else "chat.completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_obj is not None or with_usage_field:
        body["usage"] = usage_obj
    return body


def now() -> int:
    return int(time.time())
