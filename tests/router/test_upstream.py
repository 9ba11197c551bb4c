"""The router's lean HTTP/1.1 client against raw sockets that misbehave on purpose: chunked and sized
bodies, keep-alive reuse, connections the server closed while idle, answers that break off."""

from __future__ import annotations

import asyncio

import pytest

from services.router.upstream import UpstreamError, UpstreamPool


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
    return await reader.readexactly(length)


def test_sized_and_chunked_bodies_and_connection_reuse():
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if body == b"chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def scenario():
        server, url = await _serve(handler)
        pool = UpstreamPool(read_timeout=5)
        r = await pool.post(url, "/v1/x", b'{"a": 1}')
        assert r.status == 201 and await r.read() == b'{"a": 1}'
        await r.close()
        r = await pool.post(url, "/v1/x", b"chunked")
        assert r.headers["content-type"] == "text/event-stream"
        assert [c async for c in r.iter_chunks()] == [b"hello", b", world"]
        await r.close()
        assert len(connections) == 1  # both answers over one kept-alive connection
        await pool.close()
        server.close()

    asyncio.run(scenario())


def test_connection_closed_while_idle_is_retried_on_a_fresh_one():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # like a server's keep-alive timeout firing right after the answer

    async def scenario():
        server, url = await _serve(handler)
        pool = UpstreamPool(read_timeout=5)
        for _ in range(3):
            r = await pool.post(url, "/", b"{}")
            assert await r.read() == b"ok"
            await r.close()
            await asyncio.sleep(0.05)
        await pool.close()
        server.close()

    asyncio.run(scenario())


def test_refused_broken_and_silent_upstreams_are_upstream_errors():
    async def broken(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def silent(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(5)

    async def scenario():
        pool = UpstreamPool(read_timeout=0.3)
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.post("http://127.0.0.1:1", "/", b"{}")
        server, url = await _serve(broken)
        r = await pool.post(url, "/", b"{}")
        with pytest.raises(UpstreamError, match="broke off"):
            await r.read()
        await r.close()
        server.close()
        server, url = await _serve(silent)
        with pytest.raises(UpstreamError, match="no answer"):
            await pool.post(url, "/", b"{}")
        server.close()

    asyncio.run(scenario())
