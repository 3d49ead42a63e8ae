"""B01: a stream is relayed event by event, never buffered (P-AGG; PD variants: test_b01_pd_stream.py).

Lock-step instead of timing: the fake backend writes event i+1 only after the client has
received event i, so a gateway that buffers the stream deadlocks (and the test times out).
"""
from __future__ import annotations

import asyncio

import pytest

from tests.cases.harness import FB, cluster, content, run_async, sse, stream, chat_chunk, cmpl_chunk


def lockstep(n: int, chat: bool):
    got = asyncio.Queue()

    async def behave(fb, req, resp, e):
        resp.start(200)
        for i in range(n):
            c = chat_chunk(f"t{i} ", "stop" if i == n - 1 else None, role=(i == 0)) if chat \
                else cmpl_chunk(f"t{i} ", "length" if i == n - 1 else None)
            resp.write(sse(c))
            e.tokens_written += 1
            await asyncio.wait_for(got.get(), 10)   # the client saw it before the next one
        resp.end(b"data: [DONE]\n\n")
    return behave, got


@pytest.mark.parametrize("path,chat", [("/v1/chat/completions", True), ("/v1/completions", False)])
@run_async
async def test_events_reach_the_client_one_by_one(path, chat):
    behave, got = lockstep(10, chat)
    async with cluster(fbs=[FB(behave=behave)]) as (fbs, gw):
        body = (b'{"model":"m","messages":[{"role":"user","content":"count"}],"stream":true,"max_tokens":10}'
                if chat else b'{"model":"m","prompt":"count","stream":true,"max_tokens":10}')
        st, h, evs, _ = await stream(gw.port, path, body, on_event=lambda p: got.put_nowait(p))
        assert st == 200 and h["content-type"].startswith("text/event-stream")
        assert "content-length" not in h and h["transfer-encoding"] == "chunked"
        assert content(evs) == [f"t{i} " for i in range(10)]
        assert evs.count(b"[DONE]") == 1 and evs[-1] == b"[DONE]"
        assert gw.inflight() == 0


@run_async
async def test_many_tiny_events_are_not_coalesced():
    behave, got = lockstep(300, True)
    async with cluster(fbs=[FB(behave=behave)]) as (fbs, gw):
        body = b'{"model":"m","messages":[{"role":"user","content":"count"}],"stream":true}'
        st, _, evs, reads = await stream(gw.port, "/v1/chat/completions", body,
                                         on_event=lambda p: got.put_nowait(p))
        assert st == 200 and len(content(evs)) == 300
        assert reads >= 300   # one chunk per event at least
