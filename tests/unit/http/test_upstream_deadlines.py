"""The upstream client's wait bounds on one kept-alive connection, both implementations.

The compiled client keeps one timer per connection and moves its deadline (a wait that ends
leaves the timer armed; the next wait's later deadline is checked when it fires, an
earlier one re-arms it). These exchanges pin what that must not change: a short bound
after a long one still fires, and a bound moved forward by each chunk never fires early.
"""
from __future__ import annotations

import asyncio

import pytest

from motor.http.client import UpstreamTimeout
from tests.support.gateway import run_async


async def _scripted(script):
    """A raw HTTP/1.1 server on 127.0.0.1 that runs ``script(reader, writer, stop)`` for
    each connection (``stop``: an event set when the test ends); returns (server, port,
    stop)."""
    stop = asyncio.Event()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await script(reader, writer, stop)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], stop


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


@run_async
async def test_short_bound_after_long_one_on_the_same_connection(upstream_impl):
    async def script(reader, writer, stop):
        await _read_head(reader)          # request 1: answered at once
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await _read_head(reader)          # request 2: never answered
        await stop.wait()
    srv, port, stop = await _scripted(script)
    pool = upstream_impl.Pool("127.0.0.1", port, max_connections=1)
    try:
        r = await pool.request(b"GET", b"/a", first_byte_timeout_s=60, idle_timeout_s=60)
        assert await r.read() == b"ok"
        assert pool.open_connections == 1     # kept alive: the next request reuses it
        with pytest.raises(UpstreamTimeout) as e:
            await asyncio.wait_for(
                pool.request(b"GET", b"/b", first_byte_timeout_s=0.3, idle_timeout_s=60), 10)
        assert (e.value.phase, e.value.timeout_s) == ("first byte", 0.3)
    finally:
        stop.set()
        pool.close()
        srv.close()
        await srv.wait_closed()


@run_async
async def test_bound_moved_forward_by_each_chunk_then_silence(upstream_impl):
    n = 6

    async def script(reader, writer, stop):
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(n):                # a chunk every 0.15 s, under the 0.4 s bound ...
            writer.write(b"2\r\n%02d\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.15)
        await stop.wait()                 # ... then silence
    srv, port, stop = await _scripted(script)
    pool = upstream_impl.Pool("127.0.0.1", port)
    try:
        r = await pool.request(b"GET", b"/s", first_byte_timeout_s=5, idle_timeout_s=0.4)
        got = []
        with pytest.raises(UpstreamTimeout) as e:
            while True:
                chunk = await asyncio.wait_for(r.next_chunk(), 10)
                assert chunk is not None
                got.append(chunk)
        assert b"".join(got) == b"".join(b"%02d" % i for i in range(n))
        assert (e.value.phase, e.value.timeout_s) == ("idle", 0.4)
        r.close()
    finally:
        stop.set()
        pool.close()
        srv.close()
        await srv.wait_closed()
