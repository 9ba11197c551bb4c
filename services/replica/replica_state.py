"""One model replica as the HTTP layer and the registry see it: its async engine plus engine health.

An engine that dies or restarts must neither hang requests nor leave routers sending traffic to it.
In-flight requests are failed by the async engine's error path; this class then marks the replica
unhealthy (published to the registry, /health answers 503), probes the engine until it answers again,
re-handshakes (a restarted engine has an empty KV cache, so the prefix cache bookkeeping and the
published block set are cleared) and marks it healthy: the replica rejoins by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable

from services.registry.model import ReplicaLoad
from services.request.sampling_params import SamplingParams
from services.scheduler.request_output import RequestOutput, SchedulerStats

log = logging.getLogger(__name__)

PROBE_INTERVAL = 1.0  # seconds between engine probes while idle (busy engines are probed by their steps)
RECOVERY_INTERVAL = 0.25


class GeometryChangedError(RuntimeError):
    pass


class Replica:
    def __init__(self, core, loop, executor):
        self.core = core  # services.scheduler.core.SchedulerCore
        self.loop = loop  # services.scheduler.async_scheduler.AsyncScheduler: the step loop thread
        self.executor = executor
        self.healthy = True
        self.last_error: str | None = None
        self.on_engine_reset: list[Callable[[], None]] = []  # e.g. the publisher's reset_blocks

    # -- the HTTP layer's engine client ------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.loop.generate(request_id, prompt_token_ids, params, lora_name):
            if out.error and out.error_kind == "engine":
                self.mark_unhealthy(out.error)
            yield out

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def admit(self, num_seqs: int):
        return self.loop.admit(num_seqs)

    # -- the registry publisher's source -----------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.loop.stats()

    def load(self) -> ReplicaLoad:
        s = self.stats()
        return ReplicaLoad(num_waiting=s.num_waiting, num_running=s.num_running, kv_usage=s.kv_usage,
                           healthy=self.healthy)

    def drain_kv_events(self) -> list:
        return self.core.drain_kv_events()

    # -- engine health -----------------------------------------------------------------------------
    def mark_unhealthy(self, reason: str) -> None:
        if self.healthy:
            log.error("engine failed (%s): replica marked unhealthy until the engine answers again", reason)
        self.healthy = False
        self.last_error = reason

    async def supervise(self) -> None:
        """Probe the engine (when idle, or while unhealthy) and bring the replica back when it answers."""
        probe = self.executor.probe
        while True:
            await asyncio.sleep(PROBE_INTERVAL if self.healthy else RECOVERY_INTERVAL)
            if self.healthy and self.core.has_unfinished():
                continue  # steps are running: a failure surfaces through them
            instance = await asyncio.to_thread(probe, 1.0)
            if instance is None:
                self.mark_unhealthy(f"engine at {self.executor.url} is unreachable")
                continue
            if instance != self.executor.instance:
                self.mark_unhealthy("engine restarted")
                if self.core.has_unfinished():
                    continue  # the async engine's error path is still failing the old requests
                try:
                    await asyncio.to_thread(self._adopt_new_engine)
                except GeometryChangedError as exc:
                    log.critical("%s; shutting down so the scheduler restarts with it", exc)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
            if not self.healthy:
                log.info("engine at %s answers again; replica healthy", self.executor.url)
                self.healthy = True
                self.last_error = None

    def _adopt_new_engine(self) -> None:
        old = self.core.info
        info = self.executor.handshake()
        if (info.block_size, info.num_kv_blocks, info.model_id) != (old.block_size, old.num_kv_blocks, old.model_id):
            # Another geometry means new block tables: only a fresh scheduler process can adopt it.
            raise GeometryChangedError(f"engine came back with another model or KV geometry ({info})")
        # Nothing is in flight; this clears the prefix cache. Run on the engine loop's thread, the only
        # one that may touch the core.
        self.loop.call(self.core.fail_all, "engine restarted")
        for hook in self.on_engine_reset:
            hook()
