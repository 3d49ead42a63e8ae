"""B01 (PD variants): the decode stream is relayed event by event in P-PD-VLLM and
P-PD-SGL. Lock-step: the decode FB writes event i+1 only after the client received
event i, so a gateway that buffers the decode stream deadlocks (and the test fails)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from motor.config.schema import Role
from tests.cases.harness import FB, chat_chunk, cmpl_chunk, content, run_async, sse, stream
from tests.support.gateway import Gateway


def pd_pair(n: int, chat: bool, sgl: bool):
    got: asyncio.Queue = asyncio.Queue()
    rooms: dict = {}

    def room_event(body):
        key = (orjson.dumps(body.get("bootstrap_host")), orjson.dumps(body.get("bootstrap_room")))
        return rooms.setdefault(key, asyncio.Event())

    async def p(fb, req, resp, e):
        body = orjson.loads(req.body)
        if sgl:
            room_event(body).set()      # the peer may go on
        resp.send(200, orjson.dumps({"id": "p", "object": "x", "model": "m", "choices": [
            {"index": 0, "text": "P", "finish_reason": "length"}],
            "kv_transfer_params": None if sgl else {"do_remote_prefill": True, "remote_engine_id": "p"}}))

    async def d(fb, req, resp, e):
        body = orjson.loads(req.body)
        if sgl:   # rendezvous: wait for the prefill of the same (host, room)
            await asyncio.wait_for(room_event(body).wait(), 10)
        else:
            assert body["kv_transfer_params"]["remote_engine_id"] == "p"
        resp.start(200)
        for i in range(n):
            c = chat_chunk(f"t{i} ", "stop" if i == n - 1 else None, role=(i == 0)) if chat \
                else cmpl_chunk(f"t{i} ", "length" if i == n - 1 else None)
            resp.write(sse(c))
            e.tokens_written += 1
            await asyncio.wait_for(got.get(), 10)
        resp.end(b"data: [DONE]\n\n")
    return FB(behave=p), FB(behave=d), got


@pytest.mark.parametrize("mode", ["pd_prefill_first", "pd_bootstrap"])
@pytest.mark.parametrize("path,chat", [("/v1/chat/completions", True), ("/v1/completions", False)])
@run_async
async def test_pd_decode_stream_not_buffered(mode, path, chat):
    fp, fd, got = pd_pair(10, chat, mode == "pd_bootstrap")
    await fp.start()
    await fd.start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", fp.port), (Role.DECODE, "127.0.0.1", fd.port)],
                       mode=mode).start()
    try:
        body = (b'{"model":"m","messages":[{"role":"user","content":"count"}],"stream":true,"max_tokens":10}'
                if chat else b'{"model":"m","prompt":"count","stream":true,"max_tokens":10}')
        st, h, evs, _ = await stream(gw.port, path, body, on_event=lambda x: got.put_nowait(x))
        assert st == 200 and h["content-type"].startswith("text/event-stream")
        assert "content-length" not in h and h["transfer-encoding"] == "chunked"
        assert content(evs) == [f"t{i} " for i in range(10)]
        assert evs.count(b"[DONE]") == 1 and evs[-1] == b"[DONE]"
        if mode == "pd_bootstrap":   # bootstrap port from the prefill's /server_info
            assert fd.gen()[-1].json["bootstrap_port"] == 8998
        assert gw.inflight() == 0
    finally:
        await gw.stop()
        await fp.stop()
        await fd.stop()
