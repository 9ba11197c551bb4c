"""Async plumbing of one HTTP request: merging per-prompt output streams, and watching for a client
that went away (so its request is aborted and its KV blocks freed at once, not at max_tokens)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

_DONE = object()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def until_disconnect(awaitable, request: Request):
    """Await `awaitable`, or raise ClientGone if the client disconnects first (then it is cancelled)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (stream index, item), in arrival order."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:  # surfaced to the consumer, which owns error handling
            await queue.put((i, exc))
        finally:
            await queue.put((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
