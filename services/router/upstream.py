"""A lean HTTP/1.1 client for the router's one kind of upstream call: POST JSON, relay the answer.

The router's budget is under 2 ms per request; a general-purpose client (httpx) spends about 0.8 ms
of it per call on loopback, raw asyncio streams about 0.05 ms. This speaks exactly what the schedulers
send: Content-Length or chunked bodies, keep-alive, nothing else. Idle connections are pooled per
replica; a pooled connection the server already closed is retried once on a fresh one (the request
never reached the server, so this is safe for a POST).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_HEAD_LIMIT = 64 * 1024
_MAX_IDLE_PER_HOST = 256


class UpstreamError(Exception):
    """The replica could not be reached, or its answer broke off."""


class UpstreamResponse:
    def __init__(self, pool: UpstreamPool, key: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, status: int, headers: dict[str, str], timeout: float):
        self._pool, self._key, self._reader, self._writer = pool, key, reader, writer
        self.status = status
        self.headers = headers
        self._timeout = timeout
        self._done = False  # body fully read: the connection may be reused
        self._closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await self._read(self._reader.readuntil(b"\r\n"))
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while await self._read(self._reader.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    data = await self._read(self._reader.readexactly(size + 2))
                    yield data[:-2]
            elif "content-length" in self.headers:
                length = int(self.headers["content-length"])
                if length:
                    yield await self._read(self._reader.readexactly(length))
            else:  # delimited by the connection's end: never reusable
                while chunk := await self._read(self._reader.read(65536)):
                    yield chunk
                return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as exc:
            raise UpstreamError(f"answer broke off: {type(exc).__name__}: {exc}") from None
        self._done = self.headers.get("connection", "").lower() != "close"

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def close(self) -> None:
        """Return the connection to the pool if the answer was read whole, else drop it (which also
        tells the scheduler that nobody listens any more)."""
        if self._closed:
            return
        self._closed = True
        if self._done:
            self._pool.release(self._key, self._reader, self._writer)
        else:
            self._writer.close()

    async def _read(self, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self._timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"no data for {self._timeout:g}s") from None


class UpstreamPool:
    def __init__(self, connect_timeout: float = 2.0, read_timeout: float = 600.0,
                 extra_headers: dict[str, str] | None = None):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # Sent with every request (the internal token); values are ours, never a client's.
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (extra_headers or {}).items())
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = \
            defaultdict(list)

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> UpstreamResponse:
        """`headers`: this request's own, besides the pool's (values the router computed, never a client's)."""
        parts = urlsplit(base_url)
        extra = self._extra + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        request = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
                   ).encode() + body
        pooled = self._take(key)
        if pooled is not None:
            try:
                return await self._exchange(key, *pooled, request)
            except _StaleConnection:
                pass  # the server closed it while idle; our request never got there
        reader, writer = await self._connect(key)
        try:
            return await self._exchange(key, reader, writer, request)
        except _StaleConnection as exc:
            raise UpstreamError(f"connection closed before an answer: {exc}") from None

    def release(self, key, reader, writer) -> None:
        idle = self._idle[key]
        if len(idle) < _MAX_IDLE_PER_HOST and not reader.at_eof():
            idle.append((reader, writer))
        else:
            writer.close()

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()

    def _take(self, key):
        idle = self._idle.get(key)
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def _connect(self, key):
        try:
            return await asyncio.wait_for(asyncio.open_connection(*key, limit=_HEAD_LIMIT), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None

    async def _exchange(self, key, reader, writer, request: bytes) -> UpstreamResponse:
        try:
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            raise _StaleConnection(str(exc)) from None
        except asyncio.TimeoutError:
            writer.close()
            raise UpstreamError(f"no answer within {self.read_timeout:g}s") from None
        except BaseException:
            writer.close()  # cancelled (the client left) or worse: the connection is in an unknown state
            raise
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            writer.close()
            raise UpstreamError(f"malformed status line {lines[0]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return UpstreamResponse(self, key, reader, writer, status, headers, self.read_timeout)


class _StaleConnection(Exception):
    pass
