"""B06: a client that goes away (FIN or RST; before the first byte, mid-stream, or waiting
for a non-streamed answer) aborts the upstream request at once; load counters back to 0."""
from __future__ import annotations

import asyncio
import socket
import struct

import orjson
import pytest

from motor.config.schema import Role
from tests.cases.harness import FB, chat_chunk, cluster, open_request, run_async, sse, wait_for
from tests.support.gateway import Gateway

BODIES = {
    "/v1/chat/completions": b'{"model":"m","messages":[{"role":"user","content":"write a book"}],"stream":true,"max_tokens":600}',
    "/v1/completions": b'{"model":"m","prompt":"write a book","stream":true,"max_tokens":600}',
    "/generate": b'{"text":"write a book","sampling_params":{"max_new_tokens":600},"stream":true}',
}


def close(writer: asyncio.StreamWriter, rst: bool) -> None:
    if rst:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("path", list(BODIES))
@run_async
async def test_mid_stream_disconnect_aborts_upstream(path, rst):
    async with cluster(fbs=[FB(tokens=600, token_delay_s=0.02)]) as (fbs, gw):
        reader, writer = await open_request(gw.port, path, BODIES[path])
        got = b""
        while got.count(b"data: ") < 3:
            got += await asyncio.wait_for(reader.read(4096), 10)
        close(writer, rst)
        e = fbs[0].log[0]
        assert await wait_for(lambda: e.closed_at is not None, 2.0)
        assert not e.complete and e.tokens_written < 30
        n = e.tokens_written
        await asyncio.sleep(0.1)
        assert e.tokens_written == n   # it stopped producing
        assert await wait_for(lambda: gw.inflight() == 0, 2.0)


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_disconnect_before_the_first_byte_aborts_upstream(stream):
    async def slow_headers(fb, req, resp, e):
        await asyncio.sleep(30)

    async with cluster(fbs=[FB(behave=slow_headers)]) as (fbs, gw):
        body = BODIES["/v1/chat/completions"] if stream else \
            b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
        reader, writer = await open_request(gw.port, "/v1/chat/completions", body)
        assert await wait_for(lambda: len(fbs[0].log) == 1)
        close(writer, False)
        assert await wait_for(lambda: fbs[0].log[0].closed_at is not None, 2.0)
        assert await wait_for(lambda: gw.inflight() == 0, 2.0)


def pd_pair(sgl: bool):
    """FB-P, FB-D: SGLang-style P holds its answer open (a prefill that has not finished its
    KV transfer), so only the gateway can release it; D streams 600 slow tokens."""
    d_done = asyncio.Event()

    async def p(fb, req, resp, e):
        if sgl:
            await asyncio.sleep(3600)
        resp.send(200, orjson.dumps({"id": "p", "object": "x", "model": "m", "choices": [
            {"index": 0, "text": "P", "finish_reason": "length"}],
            "kv_transfer_params": None if sgl else {"do_remote_prefill": True, "remote_engine_id": "p"}}))

    async def d(fb, req, resp, e):
        resp.start(200)
        try:
            for i in range(600):
                if resp.client_gone:
                    raise ConnectionResetError()
                resp.write(sse(chat_chunk(f"t{i} ", None, role=(i == 0))))
                e.tokens_written += 1
                await resp.drain()
                await asyncio.sleep(0.02)
            resp.end(b"data: [DONE]\n\n")
        finally:
            d_done.set()
    return FB(behave=p), FB(behave=d)


@pytest.mark.parametrize("mode", ["pd_bootstrap", "pd_prefill_first"])
@run_async
async def test_pd_disconnect_releases_both_legs(mode):
    fp, fd = pd_pair(mode == "pd_bootstrap")
    await fp.start()
    await fd.start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", fp.port), (Role.DECODE, "127.0.0.1", fd.port)],
                       mode=mode).start()
    try:
        reader, writer = await open_request(gw.port, "/v1/chat/completions", BODIES["/v1/chat/completions"])
        got = b""
        while got.count(b"data: ") < 3:
            got += await asyncio.wait_for(reader.read(4096), 10)
        close(writer, False)
        d = fd.log[0]
        assert await wait_for(lambda: d.closed_at is not None, 2.0)
        assert d.tokens_written < 30
        p = fp.log[0]
        if mode == "pd_bootstrap":     # the pending prefill leg is released too
            assert await wait_for(lambda: p.closed_at is not None, 2.0) and not p.complete
        else:                          # prefill-first: P answered before D started
            assert p.complete
        assert await wait_for(lambda: gw.inflight() == 0, 2.0)
    finally:
        await gw.stop()
        await fp.stop()
        await fd.stop()
