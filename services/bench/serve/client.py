"""One benchmark request against any OpenAI-compatible server, timed from the client's side.

Streams every request (the way interactive users are served) and records the time of each chunk that
carries a choice, as `vllm bench serve` does: a token may have no text yet (half a UTF-8 character, a
special token) and is still a token, so TTFT times the first token, not the first visible character.
ITL is the gaps between chunks, TPOT (end-to-end minus TTFT) is over the output tokens after the first,
which come from the server's own usage count. Multi-turn sessions
run their turns in order, each sending the conversation so far, the server's earlier answers included.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from services.bench.serve.workloads import STRUCTURED_SCHEMA, ServeRequest


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    status: int | None = None
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _delta_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def stream_one(client: httpx.AsyncClient, base_url: str, body: dict, path: str, t0: float,
                     index: int, headers: dict | None = None) -> RequestResult:
    res = RequestResult(index, start=time.perf_counter() - t0)
    begin = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", base_url + path, json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.ok = res.error == ""
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                    continue
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if chunk.get("choices"):
                    # Every chunk with a choice marks tokens, even one with no text yet (a partial
                    # character, a special token): counted as vLLM's benchmark counts them.
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - begin
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += _delta_text(chunk)
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.e2e = time.perf_counter() - begin
    if res.ok and not res.output_tokens:
        res.output_tokens = len(res.itl) + (res.ttft is not None)  # a server without usage: count events
    return res


def completion_body(model: str, req: ServeRequest, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if req.structured:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "items", "schema": STRUCTURED_SCHEMA, "strict": True}}
    return body


async def run_session(client: httpx.AsyncClient, base_url: str, model: str, req: ServeRequest, t0: float,
                      ignore_eos: bool, headers: dict | None = None) -> list[RequestResult]:
    """The turns of one multi-turn session, in order; a failed turn ends the session."""
    messages: list[dict] = []
    results = []
    for turn, user in enumerate(req.user_turns):
        messages.append({"role": "user", "content": user})
        body = {"model": model, "messages": list(messages), "max_tokens": req.max_tokens, "temperature": 0.0,
                "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        res = await stream_one(client, base_url, body, "/v1/chat/completions", t0,
                               req.index * len(req.user_turns) + turn, headers)
        results.append(res)
        if not res.ok:
            break
        messages.append({"role": "assistant", "content": res.text})
    return results
