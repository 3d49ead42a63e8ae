"""N10: a draining gateway (SIGTERM: ``HttpServer.shutdown``) finishes the streams in flight,
admits nothing new (a new connection is refused, a request on a kept-alive connection gets an
immediate 503 or a closed connection, never 200 from /health or /readiness, never a stream
started and then cut), and ends the streams still running at the drain deadline without a
clean ``[DONE]``."""
from __future__ import annotations

import asyncio

import orjson

from tests.cases.harness import FB, chat_chunk, cluster, open_request, run_async, sse, wait_for


async def timed(fb, req, resp, e):
    """Streams one token every 50 ms for ``seconds`` (from the request's "user" field)."""
    body = orjson.loads(req.body)
    seconds = float(body.get("user") or 1)
    resp.start(200)
    e.started = asyncio.get_running_loop().time()
    n = int(seconds / 0.05)
    for i in range(n):
        if resp.client_gone:
            raise ConnectionResetError()
        resp.write(sse(chat_chunk(f"t{i} ", "stop" if i == n - 1 else None, role=(i == 0))))
        await resp.drain()
        await asyncio.sleep(0.05)
    resp.end(b"data: [DONE]\n\n")


def _chat(seconds: float) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                         "stream": True, "user": str(seconds)})


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(-1), 30)
    except (ConnectionError, asyncio.IncompleteReadError):
        return b""


async def _request(reader, writer, port: int, method: str, path: str) -> bytes:
    writer.write(f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), 5)
    except (ConnectionError, asyncio.IncompleteReadError):
        return b""


@run_async
async def test_drain_finishes_in_flight_admits_nothing_new():
    fbs = [FB(behave=timed), FB(behave=timed)]
    drain_s = 1.5
    async with cluster(fbs=fbs) as (fbs, gw):
        # K1: a kept-alive connection, idle (its last answer ended before the drain)
        k_reader, k_writer = await asyncio.open_connection("127.0.0.1", gw.port)
        first = await _request(k_reader, k_writer, gw.port, "GET", "/health")
        assert first.startswith(b"HTTP/1.1 200")
        r1 = await open_request(gw.port, "/v1/chat/completions", _chat(0.7))   # ends in time
        r2 = await open_request(gw.port, "/v1/chat/completions", _chat(30))    # does not
        assert await wait_for(lambda: sum(len(fb.log) for fb in fbs) == 2)
        drain = asyncio.ensure_future(gw.server.shutdown(drain_s))
        await asyncio.sleep(0.2)
        # a new connection is refused (or answered 503 at once)
        try:
            n_reader, n_writer = await asyncio.open_connection("127.0.0.1", gw.port)
            got = await _request(n_reader, n_writer, gw.port, "GET", "/health")
            n_writer.close()
            assert not got.startswith(b"HTTP/1.1 200")
        except ConnectionError:
            pass
        # K1: health, readiness and a new stream: never 200, never started
        for path in ("/health", "/readiness"):
            got = await _request(k_reader, k_writer, gw.port, "GET", path)
            assert not got.startswith(b"HTTP/1.1 200"), got
            if not got:
                break                                 # the connection was closed: fine
        k_writer.close()
        n_before = sum(len(fb.log) for fb in fbs)
        # R1 completes with [DONE]; its connection then admits nothing new either
        out1 = await asyncio.wait_for(r1[0].readuntil(b"\r\n0\r\n\r\n"), 10)
        assert out1.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in out1
        body = _chat(30)
        r1[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b"application/json\r\ncontent-length: " + str(len(body)).encode()
                    + b"\r\n\r\n" + body)
        late = await _read_all(r1[0])
        assert not late.startswith(b"HTTP/1.1 200"), late[:200]
        # R2 is cut at the deadline: no clean [DONE]
        out2 = await _read_all(r2[0])
        assert b"data: [DONE]" not in out2 or b"error" in out2.split(b"data: [DONE]")[0][-400:]
        await asyncio.wait_for(drain, drain_s + 5)
        assert sum(len(fb.log) for fb in fbs) == n_before == 2   # nothing new reached an engine
        long = [e for fb in fbs for e in fb.log if b'"user":"30' in e.body]
        assert len(long) == 1 and await wait_for(lambda: long[0].closed_at is not None, 3)
        for r in (r1, r2):
            r[1].close()
