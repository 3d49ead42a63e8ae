"""N09: clients that stop reading. A stalled stream holds back its engine (bounded
buffering), is cut after ``send_timeout_s`` with its engine request ended; with every pooled
connection of an endpoint held by stalled streams a new request is answered after
``timeouts.pool_wait_s`` instead of waiting without end; after a burst only
``max_idle_connections_per_endpoint`` idle engine connections stay open; an engine event
without an end is not buffered without end."""
from __future__ import annotations

import asyncio
import socket

import orjson

from motor.coordinator.routing import base
from tests.cases.harness import FB, cluster, http, run_async, stream, wait_for, write_events

STREAM = b'{"model":"m","prompt":"x","max_tokens":2000,"stream":true}'
EVENT = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "x" * 8000}]}) + b"\n\n"
LAST = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) \
    + b"\n\n"


async def flood(fb, req, resp, e):
    """2,000 events of 8 KB as fast as the gateway takes them (16 MB)."""
    resp.start(200)
    await write_events(resp, e, [EVENT] * 2000 + [LAST])
    resp.end(b"data: [DONE]\n\n")


async def stalled_client(port: int, body: bytes = STREAM) -> tuple[asyncio.StreamReader,
                                                                    asyncio.StreamWriter]:
    """A client that sends a streaming request and then never reads (4 KB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    r, w = await asyncio.open_connection(sock=s)
    w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))
    await w.drain()
    return r, w


@run_async
async def test_stalled_stream_is_cut_after_the_send_timeout_and_its_engine_request_ends():
    fb = FB(behave=flood)
    async with cluster(fbs=[fb], send_timeout_s=0.5) as (_fbs, gw):
        _r, w = await stalled_client(gw.port)
        assert await wait_for(lambda: len(fb.log) == 1)
        # bounded: the engine is held back long before its 2,000 events are written
        assert await wait_for(lambda: fb.log[0].closed_at is not None, timeout_s=10)
        assert fb.log[0].tokens_written < 2000 and not fb.log[0].complete
        assert await wait_for(lambda: gw.inflight() == 0)
        # a normal client meanwhile and after is served in full
        st, _, events, _ = await stream(gw.port, "/v1/completions", STREAM)
        assert st == 200 and events[-1] == b"[DONE]"
        assert len([e for e in events if b'"x' in e]) == 2000
        assert not any(b'"error"' in e for e in events)
        # the cut is a reset: what the gateway still had queued for the stalled client is
        # dropped, not held (with the connection in FIN-WAIT-1) until the client reads it
        got, reset = 0, False
        try:
            while True:
                chunk = await asyncio.wait_for(_r.read(1 << 16), 5)
                if not chunk:
                    break
                got += len(chunk)
        except ConnectionResetError:
            reset = True
        assert reset, f"no reset: the client could still read {got} bytes and an end of stream"
        w.close()


@run_async
async def test_a_new_request_is_answered_when_stalled_streams_hold_every_connection():
    fb = FB(behave=flood)
    async with cluster(fbs=[fb], send_timeout_s=0, max_connections_per_endpoint=2,
                       timeouts={"pool_wait_s": 0.2}, retries={"max_attempts": 1}) as (_f, gw):
        held = [await stalled_client(gw.port) for _ in range(2)]
        assert await wait_for(lambda: len(fb.log) == 2)
        st, hdrs, body = await http(gw.port, "POST", "/v1/completions",
                                    b'{"model":"m","prompt":"x","max_tokens":1}', timeout=10)
        # busy, not broken: 503 with Retry-After, as docs/configuration.md (pool_wait_s) says
        assert st == 503 and "busy" in orjson.loads(body)["error"]["message"]
        assert hdrs.get("retry-after") == "1", hdrs
        assert len(fb.log) == 2                       # it never reached the engine
        ep = next(iter(gw.table.endpoints.values()))
        assert ep.breaker.state == 0                  # a full endpoint is not a failing one
        for _r, w in held:
            w.close()


@run_async
async def test_idle_connections_after_a_burst_are_capped():
    fb = FB(tokens=2, token_delay_s=0.01)
    async with cluster(fbs=[fb], max_idle_connections_per_endpoint=4) as (_f, gw):
        body = b'{"model":"m","prompt":"x","max_tokens":3,"stream":true}'
        results = await asyncio.gather(*[stream(gw.port, "/v1/completions", body)
                                         for _ in range(24)])
        assert all(r[0] == 200 for r in results)
        pool = next(iter(gw.table.endpoints.values())).pool
        assert pool.idle_connections <= 4 and pool.open_connections <= 4


async def no_boundary(fb, req, resp, e):
    resp.start(200)
    resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    for _ in range(64):                               # one event that never ends
        resp.write(b"x" * 1024)
        await resp.drain()
        await asyncio.sleep(0)
    await asyncio.sleep(30)


@run_async
async def test_an_engine_event_without_an_end_is_not_buffered_without_end(monkeypatch):
    monkeypatch.setattr(base, "MAX_SSE_EVENT_BYTES", 8 * 1024)
    fb = FB(behave=no_boundary)
    async with cluster(fbs=[fb], failover={"enabled": False}) as (_f, gw):
        st, _, events, _ = await stream(gw.port, "/v1/completions",
                                        b'{"model":"m","prompt":"x","max_tokens":5,'
                                        b'"stream":true}')
        assert st == 200
        assert any(b'"error"' in ev for ev in events) and events[-1] == b"[DONE]"
        assert await wait_for(lambda: fb.log[0].closed_at is not None)
