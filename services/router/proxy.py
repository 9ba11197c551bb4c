"""Forwarding one request to a ranked list of replicas, and relaying the answer as it streams.

A replica that fails before its first byte (connection refused or reset, a 502/503/504) is skipped and
the next one tried (never for a 500: the request itself failed there), and so is one that cannot load the
LoRA adapter a request names (a 503 coded `lora_unavailable`; when every replica tried says so, the client
gets a 404 naming the adapter, never a 5xx); after the first byte the answer
is committed, and a broken stream ends with an SSE error event rather than a silent hang. Closing the
upstream response when the client leaves makes the scheduler see the disconnect and free the request's
KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.contracts.internal_auth import HEADER, InternalToken
from services.model_files.lora_files import UNAVAILABLE_CODE
from services.openai_api.errors import APIError, error_body
from services.openai_api.streams import ClientGone, until_disconnect
from services.registry.model import ReplicaState
from services.router.metrics import RouterMetrics
from services.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# A replica that is down, restarting or full answers these; another replica may serve the request. A
# 500 means the request itself failed there (the scheduler isolates such failures): retrying it
# elsewhere would only spread a poison request, so it is relayed as it is.
RETRYABLE = frozenset({502, 503, 504})
REPLICA_HEADER = "x-pagedserve-replica"


class Proxy:
    def __init__(self, timeout: float, metrics: RouterMetrics, on_start: Callable[[str], None],
                 on_done: Callable[[str], None], internal_token: InternalToken | None = None):
        headers = {HEADER: internal_token.value} if internal_token is not None else None
        self.pool = UpstreamPool(connect_timeout=2.0, read_timeout=timeout, extra_headers=headers)
        self.metrics = metrics
        self.on_start = on_start  # in-flight bookkeeping of the replica view
        self.on_done = on_done

    async def close(self) -> None:
        await self.pool.close()

    async def forward(self, request: Request, ranked: list[ReplicaState], path: str, body: bytes,
                      headers: dict[str, str] | None = None, adapter: str | None = None) -> Response:
        """`headers`: sent with this request to every replica tried; `adapter`: the LoRA adapter it names."""
        last_error = "no replica available"
        attempts = full = refused = 0
        for attempt, replica in enumerate(ranked[:MAX_ATTEMPTS]):
            rid = replica.info.replica_id
            if attempt:
                self.metrics.retries.inc()
            self.on_start(rid)
            try:
                resp = await until_disconnect(self.pool.post(replica.info.url, path, body, headers), request)
            except ClientGone:
                self.on_done(rid)
                return Response(status_code=499)
            except UpstreamError as exc:
                self.on_done(rid)
                self.metrics.upstream_errors.inc()
                last_error = f"replica {rid}: {type(exc).__name__}: {exc}"
                log.warning("upstream attempt %d failed, %s", attempt + 1, last_error)
                continue
            attempts += 1
            if resp.status in RETRYABLE:
                detail = await self._error_detail(resp)
                full += resp.status == 503 and '"queue_full"' in detail
                refused += resp.status == 503 and f'"{UNAVAILABLE_CODE}"' in detail
                self.on_done(rid)
                self.metrics.upstream_errors.inc()
                last_error = f"replica {rid}: HTTP {resp.status}: {detail}"
                log.warning("upstream attempt %d failed, %s", attempt + 1, last_error)
                continue
            headers = {REPLICA_HEADER: rid}
            media_type = resp.headers.get("content-type", "application/json")
            self.metrics.requests.labels(str(resp.status)).inc()
            if "text/event-stream" in media_type:
                headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                return StreamingResponse(self._relay(resp, rid, media_type), status_code=resp.status,
                                         headers=headers, media_type=media_type)
            # A whole answer (the scheduler sends it complete): one body, no chunked relay.
            try:
                content = await until_disconnect(resp.read(), request)
            except ClientGone:
                return Response(status_code=499)
            except UpstreamError as exc:
                self.metrics.upstream_errors.inc()
                raise APIError(502, f"replica {rid} broke off its answer: {exc}", code="upstream_broken") from None
            finally:
                await resp.close()
                self.on_done(rid)
            return Response(content, status_code=resp.status, headers=headers, media_type=media_type)
        if adapter is not None and attempts and refused == attempts:
            # Every replica tried could not load the adapter (missing from its directory, other weights, no
            # room): a fact about the adapter, not an outage, so no 5xx.
            raise APIError(404, f"The LoRA adapter `{adapter}` could not be loaded on any replica ({last_error})",
                           "model", UNAVAILABLE_CODE)
        if attempts and full == attempts:
            # Every replica tried is at its queue bound: the client should slow down, not treat it as an outage.
            raise APIError(429, f"every replica tried is at its queue limit ({last_error})", code="queue_full",
                           headers={"Retry-After": "1"})
        raise APIError(503, f"no replica could serve the request ({last_error})", code="upstream_unavailable",
                       headers={"Retry-After": "1"})

    @staticmethod
    async def _error_detail(resp: UpstreamResponse) -> str:
        try:
            return (await resp.read())[:300].decode(errors="replace")
        except UpstreamError as exc:
            return str(exc)
        finally:
            await resp.close()

    async def _relay(self, resp: UpstreamResponse, rid: str, media_type: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.iter_chunks():
                yield chunk
        except UpstreamError as exc:
            self.metrics.upstream_errors.inc()
            log.warning("replica %s broke off a response mid-stream: %s", rid, exc)
            if "text/event-stream" in media_type:
                err = error_body(502, f"replica {rid} failed mid-stream", code="upstream_broken")
                yield ("data: " + json.dumps(err) + "\n\n").encode()
        finally:
            await resp.close()
            self.on_done(rid)
