"""The bounded queue in front of the replicas: wait for room, or for a first replica, or 429 past the bound.

A request waits here in one of two states:
- queued: replicas exist but all are saturated. Waiting here rather than in one replica's queue keeps
  the choice open: it goes to whichever replica frees up first, within the request timeout.
- held: no replica is ready at all (scale from zero, or every replica restarting). With a cold-start
  timeout the request waits for the first replica instead of a 503 at once; the `held` gauge is the
  signal that scales the replicas up from zero (it exists at 0 from the start, so a single request
  shows as a step from 0 to 1, which a lazily created 503 counter never does).

Both states share one bound (`max_queue`). Waiters re-check on every local completion and every poll
(completions of other routers' requests show up only in the registry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.openai_api.errors import APIError
from services.router.metrics import RouterMetrics
from services.router.replicas import NoReplicasError

POLL = 0.05
# Held requests wait for a pod to start (seconds to minutes): re-reading the registry 4 times a second
# each is plenty and keeps hundreds of held requests from hammering it.
HOLD_POLL = 0.25
RETRY_AFTER_SECONDS = 1

T = TypeVar("T")
_QUEUED, _HELD = "queued", "held"


class WaitingQueue:
    def __init__(self, max_queue: int, metrics: RouterMetrics, cold_start_timeout: float = 0.0,
                 on_change: Callable[[], None] | None = None):
        """`on_change`: publishes the gauges when the counts change (ModelQueues sums its queues')."""
        assert max_queue >= 0 and cold_start_timeout >= 0
        self.max_queue = max_queue
        self.cold_start_timeout = cold_start_timeout
        self.metrics = metrics
        self.counts = {_QUEUED: 0, _HELD: 0}
        self._wake = asyncio.Event()
        self._on_change = on_change or self._publish_own
        if on_change is None:  # gauges exist at 0 from the start (an owner publishes its own)
            self._publish_own()

    @property
    def waiting(self) -> int:
        """Requests waiting for room on a saturated replica."""
        return self.counts[_QUEUED]

    @property
    def held(self) -> int:
        """Requests waiting for a first ready replica."""
        return self.counts[_HELD]

    async def admit(self, pick: Callable[[], Awaitable[T | None]], timeout: float,
                    arrived: float | None = None) -> T:
        """`pick()` returns what the request needs (ranked replicas with room, a model identity), None when
        every replica is saturated, or raises NoReplicasError when none is ready. Queued requests give up
        `timeout` seconds after they started waiting, held ones `cold_start_timeout` after `arrived`."""
        arrived = time.monotonic() if arrived is None else arrived
        state, result, error = await self._try(pick)
        if state is None:
            return result
        if self.waiting + self.held >= self.max_queue:
            if error is not None:
                raise error
            raise APIError(429, f"all replicas are saturated and {self.waiting} requests are already queued; "
                           "retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        queued_since = time.monotonic() if state == _QUEUED else None
        self._enter(state)
        try:
            while True:
                now = time.monotonic()
                if state == _HELD and now - arrived >= self.cold_start_timeout:
                    raise NoReplicasError(f"no replica became ready within {self.cold_start_timeout:g}s")
                if state == _QUEUED and now - queued_since > timeout:
                    raise APIError(503, f"no replica had room within {timeout:g}s", code="queue_timeout",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL if state == _QUEUED else HOLD_POLL)
                except asyncio.TimeoutError:
                    pass
                new_state, result, _ = await self._try(pick)
                if new_state is None:
                    return result
                if new_state != state:
                    self._leave(state)
                    self._enter(new_state)
                    if new_state == _QUEUED and queued_since is None:
                        queued_since = time.monotonic()
                    state = new_state
        finally:
            self._leave(state)

    async def _try(self, pick) -> tuple[str | None, object, NoReplicasError | None]:
        """(None, result, None) when admitted; else the state to wait in (and the error when held)."""
        try:
            result = await pick()
        except NoReplicasError as exc:
            if not self.cold_start_timeout:
                raise
            return _HELD, None, exc
        if result is None:
            return _QUEUED, None, None
        return None, result, None

    def _enter(self, state: str) -> None:
        self.counts[state] += 1
        self._publish()

    def _leave(self, state: str) -> None:
        self.counts[state] -= 1
        assert self.counts[state] >= 0, self.counts
        self._publish()

    def _publish(self) -> None:
        self._on_change()

    def _publish_own(self) -> None:
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.held.set(self.held)

    def released(self) -> None:
        """A request finished here: queued ones may fit now."""
        self._wake.set()


class ModelQueues:
    """One admission queue per served model, so a burst for one model waits (and fills its bound) in its
    own queue while every other model's requests are admitted as before; plus the hold where a request
    waits until its model's identity is known (scale from zero), shared because its model is not yet
    known to exist. Keyed by base model names the registry knows, so their number is bounded by the fleet.
    """

    def __init__(self, max_queue: int, metrics: RouterMetrics, cold_start_timeout: float = 0.0):
        self.max_queue = max_queue
        self.cold_start_timeout = cold_start_timeout
        self.metrics = metrics
        self.queues: dict[str, WaitingQueue] = {}
        self.hold = WaitingQueue(max_queue, metrics, cold_start_timeout, self._publish)
        self._publish()

    def of(self, model: str) -> WaitingQueue:
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = WaitingQueue(self.max_queue, self.metrics, self.cold_start_timeout,
                                                   lambda: self._publish(model))
            self._publish(model)
        return queue

    @property
    def waiting(self) -> int:
        return self.hold.waiting + sum(q.waiting for q in self.queues.values())

    @property
    def held(self) -> int:
        return self.hold.held + sum(q.held for q in self.queues.values())

    def _publish(self, model: str | None = None) -> None:
        if model is not None:
            self.metrics.model_queue_depth.labels(model).set(self.queues[model].waiting)
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.held.set(self.held)

    def released(self) -> None:
        """A request finished here: queued ones (of its model, and any other sharing its replicas) may fit."""
        self.hold.released()
        for q in self.queues.values():
            q.released()
