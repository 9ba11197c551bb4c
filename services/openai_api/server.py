"""Running HTTP apps: several uvicorn servers in one event loop, with one graceful shutdown for all.

uvicorn's own signal capture is per server (the last one wins), so a process with a router and a
replica app (`pagedserve serve`) installs one handler that stops every server; each then drains its
in-flight requests for up to the drain timeout, as Kubernetes' termination grace period expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine

import uvicorn

from services.openai_api.errors import error_body

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # signals are handled once for all servers, in run_servers


def make_server(app, host: str, port: int, drain_timeout: float = 30.0, log_level: str = "info",
                lifespan: str = "on") -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=int(drain_timeout), lifespan=lifespan)
    return _Server(config)


async def run_servers(servers: list[uvicorn.Server], background: list[Coroutine] = (),
                      on_stop: list[Callable[[], Awaitable]] = ()) -> None:
    """Serve until SIGINT/SIGTERM (a second SIGINT forces exit); `on_stop` runs at the signal (e.g.
    leave the registry, so routers stop sending while in-flight requests drain); background tasks
    are cancelled once every server has drained."""
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def stop(sig: int = signal.SIGTERM) -> None:
        if not stopping:
            stopping.extend(asyncio.create_task(cb()) for cb in on_stop)
        for s in servers:
            if s.should_exit and sig == signal.SIGINT:
                s.force_exit = True  # a second Ctrl-C: stop draining
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    def failed(task: asyncio.Task) -> None:
        # A background task (engine start-up, registry) that dies leaves a replica that cannot serve:
        # exit rather than linger half-alive; the supervisor (Kubernetes, `pagedserve up`) restarts it.
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed; shutting down", exc_info=task.exception())
            stop()

    tasks = [asyncio.create_task(c) for c in background]
    for t in tasks:
        t.add_done_callback(failed)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        await asyncio.gather(*stopping, return_exceptions=True)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# Liveness of the process itself (its event loop answers), apart from /health, which reports whether
# the whole chain behind it can serve. Kubernetes restarts on the first and routes on the second.
LIVENESS_PATH = "/live"


class LivenessApp:
    """Answers LIVENESS_PATH from the event loop itself, before and after start-up, and hands everything
    else to `app`: a scheduler whose engine is loading or restarting is alive (not ready), one whose
    loop is blocked or dead is not."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == LIVENESS_PATH:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"alive": true}'})
            return
        await self.app(scope, receive, send)


class StartingApp:
    """An ASGI app that answers 503 until `target` is set (the engine is still loading weights), then
    delegates to it; Kubernetes' startup probe and routers see a clear "not yet"."""

    def __init__(self, message: str = "the engine is starting"):
        self.target = None
        self.message = message

    async def __call__(self, scope, receive, send) -> None:
        if self.target is not None:
            await self.target(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        body = json.dumps(error_body(503, self.message, code="starting")).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
