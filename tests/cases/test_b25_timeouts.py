"""B25: an upstream timeout is 504 (JSON error, upstream cancelled); a silent-but-alive
stream stays open through an idle-cutting hop thanks to SSE keep-alive comments; no
total-duration limit cuts a healthy stream."""
from __future__ import annotations

import asyncio

import orjson

from tests.cases.harness import FB, cluster, content, default_behave, events, http, run_async, sse, chat_chunk, wait_for


async def sleepy(fb, req, resp, e):
    await asyncio.sleep(fb.sleep_s)
    await default_behave(fb, req, resp, e)


@run_async
async def test_a_c_first_byte_timeout_is_504_and_below_it_200():
    fb = FB(behave=sleepy)
    fb.sleep_s = 2.0
    async with cluster(fbs=[fb], timeouts={"first_token_s": 0.5}) as (fbs, gw):
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions",
                                b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
        assert st == 504 and orjson.loads(out)["error"]["code"] == 504
        assert await wait_for(lambda: fb.log[0].closed_at is not None, 1.5)   # upstream cancelled
        assert len(fb.log) == 1                                               # not retried
        fb.sleep_s = 0.2
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                              b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
        assert st == 200


async def idle_relay(upstream_port: int, idle_s: float) -> tuple[asyncio.AbstractServer, int]:
    """A TCP relay that drops a connection idle (no byte either way) for ``idle_s``."""
    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, touch) -> None:
        try:
            while True:
                data = await r.read(65536)
                if not data:
                    break
                touch()
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        last = [asyncio.get_running_loop().time()]

        def touch() -> None:
            last[0] = asyncio.get_running_loop().time()
        tasks = [asyncio.ensure_future(pipe(cr, uw, touch)), asyncio.ensure_future(pipe(ur, cw, touch))]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.02)
            if asyncio.get_running_loop().time() - last[0] > idle_s:
                cw.close()
                uw.close()
                break
        await asyncio.gather(*tasks, return_exceptions=True)

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def silent_then_tokens(fb, req, resp, e):
    resp.start(200)                      # headers at once
    await asyncio.sleep(1.5)             # "90 s" of silence (scaled)
    for i in range(10):
        resp.write(sse(chat_chunk(f"t{i} ", "stop" if i == 9 else None)))
    resp.end(b"data: [DONE]\n\n")


@run_async
async def test_b_keepalive_keeps_a_silent_stream_through_an_idle_hop():
    async with cluster(fbs=[FB(behave=silent_then_tokens)], timeouts={"keepalive_s": 0.2}) as (fbs, gw):
        srv, port = await idle_relay(gw.port, 0.6)   # the "60 s" idle hop (scaled)
        try:
            st, _, body = await http(port, "POST", "/v1/chat/completions",
                                     b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}')
        finally:
            srv.close()
        assert st == 200
        assert b": keep-alive\n\n" in body
        ev = events(body)
        assert content(ev) == [f"t{i} " for i in range(10)] and ev[-1] == b"[DONE]"
