"""A load client that classifies every outcome the way a reliability report needs it.

Each request ends as exactly one of: completed (a whole answer, or a stream that reached [DONE]),
failed with a clear error (an OpenAI error object with a 4xx/5xx status, or an SSE error event), or hung
(no end within the timeout). Separately counted: 5xx statuses, 429s (and whether they said Retry-After)
and connection failures. Only loopback targets: it is a test tool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    status: int | None  # HTTP status; None when no response came
    completed: bool = False
    clear_error: bool = False
    hung: bool = False
    dropped: bool = False  # the client left on purpose after its first token
    retry_after: bool = False
    replica: str | None = None
    seconds: float = 0.0
    error: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def counts(self) -> dict:
        c = Counter()
        for o in self.outcomes:
            c["sent"] += 1
            c["completed"] += o.completed
            c["clear_error"] += o.clear_error
            c["hung"] += o.hung
            c["dropped"] += o.dropped
            c["5xx"] += o.status is not None and o.status >= 500
            c["429"] += o.status == 429
            c["429_with_retry_after"] += o.status == 429 and o.retry_after
            c["no_response"] += o.status is None and not o.hung
        return dict(c)


def _is_error_object(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and bool(err.get("message"))


async def send(client: httpx.AsyncClient, url: str, body: dict, timeout: float, headers: dict | None = None,
               drop_after_first: bool = False) -> Outcome:
    """POST `body` to `url` (streaming when body["stream"]) and classify how it ended."""
    t0 = time.monotonic()
    out = Outcome(status=None)

    async def run() -> None:
        if body.get("stream"):
            await _stream(client, url, body, headers, out, drop_after_first)
            return
        r = await client.post(url, json=body, headers=headers)
        out.status, out.replica = r.status_code, r.headers.get("x-pagedserve-replica")
        out.retry_after = "retry-after" in r.headers
        if r.status_code == 200:
            out.completed = True
        else:
            out.clear_error, out.error = _is_error_object(r.text), r.text[:200]

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        out.hung = True
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.seconds = time.monotonic() - t0
    return out


async def _stream(client, url, body, headers, out: Outcome, drop_after_first: bool) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as r:
        out.status, out.replica = r.status_code, r.headers.get("x-pagedserve-replica")
        out.retry_after = "retry-after" in r.headers
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            out.clear_error, out.error = _is_error_object(text), text[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.completed = True
                return
            if _is_error_object(data):
                out.clear_error, out.error = True, data[:200]
                return
            if drop_after_first:
                out.dropped = True
                return  # leaving the context closes the connection: the disconnect under test
    out.error = out.error or "stream ended without [DONE] or an error event"
