"""B06: a client that goes away (FIN or RST; before the first byte, mid-stream, or waiting
for a non-streamed answer) aborts the upstream request at once; load counters back to 0."""
from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from tests.cases.harness import FB, cluster, open_request, run_async, wait_for

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


@pytest.mark.skip(reason="needs PD mode (issue 6)")
def test_pd_both_legs_released():
    """B06 in P-PD-SGL: both FB-P and FB-D released within 1 s."""
