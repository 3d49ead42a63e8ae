"""motor.http: server parsing/limits/streaming and the pooled client."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from motor.http.client import UpstreamClosed, UpstreamTimeout
from motor.http.server import HttpServer, Router
from tests.support.gateway import run_async

# every test against both protocol implementations (conftest.py: python, compiled); the
# client tests (those that take ``upstream_impl``) also against both pooled clients
pytestmark = pytest.mark.usefixtures("http_impl")


async def make_server(max_body: int = 1 << 20):
    r = Router()
    state = {"aborted": 0}

    @r.post("/echo")
    async def echo(req, resp):
        resp.send(200, req.body, headers=((b"x-echo-len", str(len(req.body)).encode()),))

    @r.get("/stream")
    async def stream(req, resp):
        resp.start(200)
        try:
            for i in range(int(req.query_params().get("n", "3"))):
                resp.write(b"data: %d\n\n" % i)
                await resp.drain()
                await asyncio.sleep(float(req.query_params().get("delay", "0")))
            resp.end(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            state["aborted"] += 1
            raise

    @r.get("/boom")
    async def boom(req, resp):
        raise RuntimeError("bug")

    @r.get("/silent")
    async def silent(req, resp):
        return

    srv = HttpServer(r, max_body_bytes=max_body)
    port = await srv.listen("127.0.0.1", 0)
    return srv, port, state


async def raw(port: int, data: bytes) -> bytes:
    rd, wr = await asyncio.open_connection("127.0.0.1", port)
    wr.write(data)
    await wr.drain()
    out = await asyncio.wait_for(rd.read(-1), 5)
    wr.close()
    return out


@run_async
async def test_keep_alive_reuses_one_connection(upstream_impl):
    srv, port, _ = await make_server()
    pool = upstream_impl.Pool("127.0.0.1", port)
    try:
        for i in range(50):
            r = await pool.request(b"POST", b"/echo", b"x%d" % i)
            assert r.status == 200 and await r.read() == b"x%d" % i
            assert r.header(b"x-echo-len") == str(len(b"x%d" % i)).encode()
        assert pool.open_connections == 1 and pool.idle_connections == 1
    finally:
        pool.close()
        await srv.shutdown(1)


@run_async
async def test_pipelined_requests_answered_in_order():
    srv, port, _ = await make_server()
    try:
        req = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nA" \
              b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nB" \
              b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\nconnection: close\r\n\r\nC"
        out = await raw(port, req)
        bodies = [part.rsplit(b"\r\n\r\n", 1)[-1][:1] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
        assert bodies == [b"A", b"B", b"C"]
    finally:
        await srv.shutdown(1)


@run_async
async def test_chunked_request_body_and_stream_response(upstream_impl):
    srv, port, _ = await make_server()
    pool = upstream_impl.Pool("127.0.0.1", port)
    try:
        out = await raw(port, b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                              b"connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert out.endswith(b"\r\n\r\nabcde")
        r = await pool.request(b"GET", b"/stream?n=4")
        chunks = [c async for c in r]
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
        assert pool.idle_connections == 1
    finally:
        pool.close()
        await srv.shutdown(1)


@run_async
async def test_malformed_request_and_oversized_body_get_openai_errors():
    srv, port, _ = await make_server(max_body=100)
    try:
        out = await raw(port, b"NOT-HTTP\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400")
        assert orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 400
        out = await raw(port, b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" + b"a" * 1000)
        assert out.startswith(b"HTTP/1.1 413")
        out = await raw(port, b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"c8\r\n" + b"a" * 200 + b"\r\n0\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413")
    finally:
        await srv.shutdown(1)


@run_async
async def test_handler_bug_gives_500_and_silent_handler_never_hangs():
    srv, port, _ = await make_server()
    try:
        out = await raw(port, b"GET /boom HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500")
        out = await raw(port, b"GET /silent HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500")
    finally:
        await srv.shutdown(1)


@run_async
async def test_client_close_cancels_handler_and_idle_timeout_fires(upstream_impl):
    srv, port, state = await make_server()
    pool = upstream_impl.Pool("127.0.0.1", port)
    try:
        r = await pool.request(b"GET", b"/stream?n=100&delay=0.05", idle_timeout_s=2)
        assert (await r.next_chunk()).startswith(b"data: 0")
        r.close()
        for _ in range(100):
            if state["aborted"]:
                break
            await asyncio.sleep(0.02)
        assert state["aborted"] == 1
        assert pool.open_connections == 0
        r = await pool.request(b"GET", b"/stream?n=3&delay=1", idle_timeout_s=0.2)
        await r.next_chunk()
        try:
            while await r.next_chunk() is not None:
                pass
            raise AssertionError("expected an idle timeout")
        except UpstreamTimeout as e:
            assert e.phase == "idle"
        r.close()
    finally:
        pool.close()
        await srv.shutdown(1)


@run_async
async def test_connection_refused_and_stale_keepalive_retry(upstream_impl):
    srv, port, _ = await make_server()
    pool = upstream_impl.Pool("127.0.0.1", port)
    r = await pool.request(b"POST", b"/echo", b"a")
    await r.read()
    # the server closes its idle keep-alive connections: the pool notices and reconnects
    await srv.shutdown(0.1)
    await asyncio.sleep(0.05)
    srv2 = HttpServer(srv.handler)
    await srv2.listen("127.0.0.1", port)
    try:
        r = await pool.request(b"POST", b"/echo", b"b")
        assert await r.read() == b"b"
    finally:
        pool.close()
        await srv2.shutdown(0.1)
    p2 = upstream_impl.Pool("127.0.0.1", port)
    try:
        await p2.request(b"POST", b"/echo", b"c")
        raise AssertionError("expected connection refused")
    except (OSError, UpstreamClosed):
        pass
    assert p2.open_connections == 0


@run_async
async def test_pool_cap_queues_callers(upstream_impl):
    srv, port, _ = await make_server()
    pool = upstream_impl.Pool("127.0.0.1", port, max_connections=2)
    try:
        async def one(i):
            r = await pool.request(b"GET", b"/stream?n=2&delay=0.02")
            return await r.read()
        outs = await asyncio.gather(*(one(i) for i in range(8)))
        assert all(o.endswith(b"[DONE]\n\n") for o in outs)
        assert pool.open_connections <= 2
    finally:
        pool.close()
        await srv.shutdown(1)


@run_async
async def test_slow_partial_request_gets_408_and_idle_keepalive_is_closed():
    r = Router()

    @r.get("/x")
    async def x(req, resp):
        resp.send(200, b"ok")
    srv = HttpServer(r, request_read_timeout_s=0.3, keepalive_timeout_s=0.5)
    port = await srv.listen("127.0.0.1", 0)
    try:
        # headers never finished (slowloris)
        rd, wr = await asyncio.open_connection("127.0.0.1", port)
        wr.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabcd")
        out = await asyncio.wait_for(rd.read(-1), 5)
        assert out.startswith(b"HTTP/1.1 408")
        assert orjson.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408
        wr.close()
        # a keep-alive connection that answered, then stays silent, is closed
        rd, wr = await asyncio.open_connection("127.0.0.1", port)
        wr.write(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
        out = await asyncio.wait_for(rd.read(-1), 5)
        assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"ok")
        wr.close()
        assert not srv.connections or all(c.closed for c in srv.connections)
    finally:
        await srv.shutdown(1)


@run_async
async def test_http10_client_gets_an_unframed_stream():
    srv, port, _ = await make_server()
    try:
        out = await raw(port, b"GET /stream?n=2 HTTP/1.0\r\nhost: x\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower()
        assert body == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
    finally:
        await srv.shutdown(1)


@run_async
async def test_head_gets_the_get_status_and_headers_without_body():
    srv, port, _ = await make_server()
    try:
        out = await raw(port, b"HEAD /stream?n=2 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == b""
    finally:
        await srv.shutdown(1)


@run_async
async def test_inflight_count_returns_to_zero_when_client_leaves_at_once():
    srv, port, state = await make_server()
    try:
        for _ in range(20):
            rd, wr = await asyncio.open_connection("127.0.0.1", port)
            wr.write(b"GET /stream?n=50&delay=0.01 HTTP/1.1\r\nhost: x\r\n\r\n")
            wr.close()
        for _ in range(100):
            if srv.inflight == 0 and not srv.connections:
                break
            await asyncio.sleep(0.02)
        assert srv.inflight == 0
    finally:
        await srv.shutdown(1)
