"""An endpoint's load counters on the request path: a streamed answer's prefill tokens
leave the load at its first token, the request stays counted until it ends, and every
counter (requests, tokens, prefill, decode) returns to exactly 0 on every path:
completed, failed, cancelled, retried and continued on another endpoint."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from hypothesis import given, settings, strategies as st

from motor._fast import relay as crelay
from motor.config.schema import Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.routing.base import past_prefill
from motor.http.client import Client
from motor.sim.engine import EngineConfig
from motor.sim.options import SimOptions
from motor.sim.server import SimServer
from tests.support.fake_backend import FakeBackend, Script
from tests.support.gateway import Gateway, http, run_async

CHAT_STREAM = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}'
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'


def counters(gw: Gateway) -> tuple[int, int, int, int]:
    eps = gw.table.endpoints.values()
    return (sum(e.inflight for e in eps), sum(e.inflight_tokens for e in eps),
            sum(e.inflight_prefill_tokens for e in eps),
            sum(e.inflight_decode_tokens for e in eps))


async def settle(gw: Gateway) -> tuple[int, int, int, int]:
    """The counters once nothing is in flight (bounded wait: releases run in finally
    blocks of tasks that may still be unwinding)."""
    for _ in range(200):
        if counters(gw) == (0, 0, 0, 0):
            break
        await asyncio.sleep(0.01)
    return counters(gw)


def test_endpoint_state_prefill_done_plain_counters():
    client = Client()
    try:
        ep = EndpointState("a", "m", Role.UNION, "127.0.0.1", 1, 0, client.pool("127.0.0.1", 1))
        ep.acquire(120, 100, 20)
        ep.acquire(60, 40, 20)
        ep.prefill_done(100)
        assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
                ep.inflight_decode_tokens) == (2, 180, 40, 40)
        ep.release(120, 0, 20)
        ep.release(60, 40, 20)           # ended before its first token
        assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
                ep.inflight_decode_tokens) == (0, 0, 0, 0)
    finally:
        client.close()


@pytest.mark.parametrize("block, past", [
    (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', False),
    (b": keep-alive\n\n", False),
    ((b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
      b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'), True),
    (b'data: {"choices":[{"delta":{"role":"assistant","content":"tok0 "}}]}\n\n', True),
    (b'data: {"choices":[{"text":"x","index":0}]}\n\n', True),
    (b"data: [DONE]\n\n", True),
])
def test_past_prefill(block, past):
    assert past_prefill(block) is past
    assert crelay.past_prefill(block) is past


_EVENT = st.sampled_from([b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}',
                          b'data: {"choices":[{"delta":{"content":"x"}}]}', b": keep-alive",
                          b"data: [DONE]", b"", b" \t", b"\x0b:x", b":", b"\x0c",
                          b'"role":"assistant","content":""', b"event: x"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(_EVENT, st.binary(max_size=3)), max_size=5), st.booleans())
def test_the_compiled_past_prefill_is_the_reference(events, blank_end):
    block = b"\n\n".join(e + pad for e, pad in events) + (b"\n\n" if blank_end else b"")
    assert crelay.past_prefill(block) is past_prefill(block)


@run_async
async def test_stream_prefill_leaves_at_first_token_request_stays_until_cancelled():
    fb = await FakeBackend().start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port)]).start()
    try:
        fb.default = Script(tokens=3, token_delay_s=30.0)   # first token, then silence
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
                     b"\r\n%s" % (len(CHAT_STREAM), CHAT_STREAM))
        await writer.drain()
        got = b""
        while b"tok0" not in got:
            got += await asyncio.wait_for(reader.read(4096), 5)
        n, tokens, prefill, decode = counters(gw)
        assert (n, prefill, decode) == (1, 0, 5) and tokens > 5   # decoding: no prefill load
        writer.close()                                             # the client leaves
        assert await settle(gw) == (0, 0, 0, 0)
    finally:
        await gw.stop()
        await fb.stop()


@pytest.mark.parametrize("script, stream", [
    (Script(), True),                                  # completed stream
    (Script(), False),                                 # whole answer (released at the end)
    (Script(mode="drop_after", drop_at=2, tokens=5), True),   # broken mid-stream, not continued
    (Script(mode="status", status=500, body=b'{"error":{"message":"x","code":500}}'), True),
])
@run_async
async def test_counters_return_to_zero(script, stream):
    fb = await FakeBackend().start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port)]).start()
    try:
        fb.script(script)
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                              CHAT_STREAM if stream else CHAT)
        assert st in (200, 500)
        assert await settle(gw) == (0, 0, 0, 0)
    finally:
        await gw.stop()
        await fb.stop()


@run_async
async def test_retried_before_first_byte_counters_return_to_zero():
    fbs = [await FakeBackend().start() for _ in range(2)]
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs]).start()
    try:
        for fb in fbs:
            fb.script(Script(mode="close"))           # whichever is picked first closes
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", CHAT_STREAM)
        assert st == 200 and body.endswith(b"data: [DONE]\n\n")
        assert await settle(gw) == (0, 0, 0, 0)
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()


@run_async
async def test_failover_mid_stream_releases_each_legs_prefill_once(tmp_path, monkeypatch):
    sims = []
    for _ in range(2):
        s = SimServer(SimOptions(host="127.0.0.1", port=0, model_dir=str(tmp_path / "tok"),
                                 engine=EngineConfig(time_scale=0.0, context_keyed_text=True)))
        s.port = await s.start()
        sims.append(s)
    gw = await Gateway([(Role.UNION, "127.0.0.1", s.port) for s in sims]).start()
    done: list[tuple[str, int]] = []
    orig = EndpointState.prefill_done

    def spy(self: EndpointState, tokens: int) -> None:
        done.append((self.key, tokens))
        orig(self, tokens)

    monkeypatch.setattr(EndpointState, "prefill_done", spy)
    try:
        # both break once after 9 tokens: leg 1 on X breaks, leg 2 on Y breaks, leg 3 on X
        # finishes (30 tokens)
        for s in sims:
            await http(s.port, "POST", "/admin/fault",
                       b'{"mode":"drop_after","tokens":9,"count":1}')
        req = {"model": "motor-sim", "stream": True, "max_tokens": 30,
               "messages": [{"role": "user", "content": "tell me"}]}
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        assert st == 200 and out.endswith(b"data: [DONE]\n\n") and b'"error"' not in out
        # one release per leg, on the endpoint that leg ran on, each after its first token
        keys = [k for k, _ in done]
        assert len(keys) == 3 and keys[0] != keys[1] and keys[2] == keys[0]
        assert all(t > 0 for _, t in done)
        assert await settle(gw) == (0, 0, 0, 0)
    finally:
        await gw.stop()
        for s in sims:
            await s.stop(drain_timeout_s=0.2)
