"""The bounded queue in front of saturated replicas: wait for room, or 429 past the bound.

Waiting here rather than in one replica's queue keeps the choice open: a queued request goes to
whichever replica frees up first. Waiters re-check on every local completion and every POLL seconds
(completions of other routers' requests show up only in the registry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.openai_api.errors import APIError
from services.router.metrics import RouterMetrics

POLL = 0.05
RETRY_AFTER_SECONDS = 1


class Admission:
    def __init__(self, max_queue: int, metrics: RouterMetrics):
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self._wake = asyncio.Event()

    async def admit(self, pick: Callable[[], Awaitable[list | None]], timeout: float) -> list:
        """`pick()` returns ranked replicas with room, or None when all are saturated."""
        ranked = await pick()
        if ranked is not None:
            return ranked
        if self.waiting >= self.max_queue:
            raise APIError(429, f"all replicas are saturated and {self.waiting} requests are already queued; "
                           "retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL)
                except asyncio.TimeoutError:
                    pass
                ranked = await pick()
                if ranked is not None:
                    return ranked
                if time.monotonic() > deadline:
                    raise APIError(503, f"no replica had room within {timeout:g}s", code="queue_timeout",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)

    def released(self) -> None:
        """A request finished here: queued ones may fit now."""
        self._wake.set()
