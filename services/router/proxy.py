"""Forwarding one request to a ranked list of replicas, and relaying the answer as it streams.

A replica that fails before its first byte (connection refused or reset, a 5xx) is skipped and the
next one tried; after the first byte the answer is committed, and a broken stream ends with an SSE
error event rather than a silent hang. Closing the upstream response when the client leaves makes the
scheduler see the disconnect and free the request's KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.api.errors import APIError, error_body
from services.api.streams import ClientGone, until_disconnect
from services.registry.model import ReplicaState
from services.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
REPLICA_HEADER = "x-pagedserve-replica"


class Proxy:
    def __init__(self, timeout: float, metrics: RouterMetrics, on_start: Callable[[str], None],
                 on_done: Callable[[str], None]):
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=2.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        self.metrics = metrics
        self.on_start = on_start  # in-flight bookkeeping of the replica view
        self.on_done = on_done

    async def close(self) -> None:
        await self.client.aclose()

    async def forward(self, request: Request, ranked: list[ReplicaState], path: str, body: bytes) -> Response:
        last_error = "no replica available"
        for attempt, replica in enumerate(ranked[:MAX_ATTEMPTS]):
            rid = replica.info.replica_id
            if attempt:
                self.metrics.retries.inc()
            self.on_start(rid)
            upstream = self.client.build_request("POST", replica.info.url + path, content=body,
                                                 headers={"content-type": "application/json"})
            try:
                resp = await until_disconnect(self.client.send(upstream, stream=True), request)
            except ClientGone:
                self.on_done(rid)
                return Response(status_code=499)
            except httpx.HTTPError as exc:
                self.on_done(rid)
                self.metrics.upstream_errors.inc()
                last_error = f"replica {rid}: {type(exc).__name__}: {exc}"
                log.warning("upstream attempt %d failed, %s", attempt + 1, last_error)
                continue
            if resp.status_code >= 500:
                detail = (await resp.aread())[:300].decode(errors="replace")
                await resp.aclose()
                self.on_done(rid)
                self.metrics.upstream_errors.inc()
                last_error = f"replica {rid}: HTTP {resp.status_code}: {detail}"
                log.warning("upstream attempt %d failed, %s", attempt + 1, last_error)
                continue
            headers = {REPLICA_HEADER: rid}
            media_type = resp.headers.get("content-type", "application/json")
            if "text/event-stream" in media_type:
                headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.metrics.requests.labels(str(resp.status_code)).inc()
            return StreamingResponse(self._relay(resp, rid, media_type), status_code=resp.status_code,
                                     headers=headers, media_type=media_type)
        raise APIError(503, f"no replica could serve the request ({last_error})", code="upstream_unavailable",
                       headers={"Retry-After": "1"})

    async def _relay(self, resp: httpx.Response, rid: str, media_type: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.inc()
            log.warning("replica %s broke off a response mid-stream: %s: %s", rid, type(exc).__name__, exc)
            if "text/event-stream" in media_type:
                err = error_body(502, f"replica {rid} failed mid-stream", code="upstream_broken")
                yield ("data: " + json.dumps(err) + "\n\n").encode()
        finally:
            await resp.aclose()
            self.on_done(rid)
