"""The union proxy path, against scriptable fake backends."""
from __future__ import annotations

import asyncio

import orjson

from motor.config.schema import Role
from tests.support.fake_backend import FakeBackend, Script
from tests.support.gateway import Gateway, http, run_async

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
CHAT_STREAM = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}'


async def setup(n: int = 2, **cfg):
    fbs = [await FakeBackend().start() for _ in range(n)]
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs], **cfg).start()
    return fbs, gw


async def teardown(fbs, gw):
    await gw.stop()
    for fb in fbs:
        await fb.stop()


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: "):] for e in body.split(b"\n\n") if e]


@run_async
async def test_non_stream_passes_body_status_and_round_robins():
    fbs, gw = await setup()
    try:
        for _ in range(4):
            st, h, body = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
            assert st == 200
            assert orjson.loads(body)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4 "
        assert [len(fb.log) for fb in fbs] == [2, 2]
        # body bytes forwarded unchanged
        assert fbs[0].log[0].body == CHAT
        assert gw.inflight() == 0
    finally:
        await teardown(fbs, gw)


@run_async
async def test_stream_is_relayed_event_by_event_with_done():
    fbs, gw = await setup(1)
    try:
        st, h, body = await http(gw.port, "POST", "/v1/chat/completions", CHAT_STREAM)
        assert st == 200 and h["content-type"].startswith("text/event-stream")
        ev = sse_events(body)
        assert ev[-1] == b"[DONE]"
        texts = [orjson.loads(e)["choices"][0]["delta"]["content"] for e in ev[:-1]]
        assert texts == [f"tok{i} " for i in range(5)]
    finally:
        await teardown(fbs, gw)


@run_async
async def test_bad_json_and_non_object_get_400_openai_error():
    fbs, gw = await setup(1)
    try:
        for body in (b"{bad", b"[1,2]", b""):
            st, _, out = await http(gw.port, "POST", "/v1/completions", body)
            assert st == 400
            err = orjson.loads(out)["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
        assert fbs[0].log == []  # nothing reached the engine
    finally:
        await teardown(fbs, gw)


@run_async
async def test_unknown_model_404_and_unknown_route_404():
    fbs, gw = await setup(1)
    try:
        # learn the model names like the health prober does
        for ep in gw.table.endpoints.values():
            ep.models = {"m"}
        st, _, out = await http(gw.port, "POST", "/v1/completions", b'{"model":"other","prompt":"x"}')
        assert st == 404 and "other" in orjson.loads(out)["error"]["message"]
        st, _, out = await http(gw.port, "GET", "/v1/nothing")
        assert st == 404 and orjson.loads(out)["error"]["code"] == 404
    finally:
        await teardown(fbs, gw)


@run_async
async def test_engine_4xx_keeps_status_and_body():
    fbs, gw = await setup(1)
    try:
        err = b'{"error":{"message":"max_tokens too big","type":"BadRequestError","param":null,"code":400}}'
        fbs[0].script(Script(mode="status", status=400, body=err))
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert st == 400 and out == err
        # 429 is retried (docs/faults.md); when every attempt gets it, the client gets it
        fbs[0].script(*[Script(mode="status", status=429, body=b"slow down")] * 3)
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert st == 429
        e = orjson.loads(out)["error"]
        assert e["code"] == 429 and "slow down" in e["message"]
    finally:
        await teardown(fbs, gw)


@run_async
async def test_dead_backend_is_retried_on_the_other_and_cooled_down():
    fbs, gw = await setup(2)
    port0 = fbs[0].port
    await fbs[0].stop()  # connection refused from now on
    try:
        for _ in range(6):
            st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
            assert st == 200, out
        assert len(fbs[1].log) == 6
        ep0 = next(e for e in gw.table.endpoints.values() if e.port == port0)
        assert ep0.failures >= 1
        assert gw.inflight() == 0
    finally:
        await teardown(fbs[1:], gw)


@run_async
async def test_all_backends_dead_gives_502_openai_error():
    fbs, gw = await setup(2)
    for fb in fbs:
        await fb.stop()
    try:
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert st == 502
        assert "attempt" in orjson.loads(out)["error"]["message"]
        assert gw.inflight() == 0
    finally:
        await gw.stop()


@run_async
async def test_stream_broken_mid_way_ends_with_one_sse_error_and_done():
    fbs, gw = await setup(1)
    try:
        fbs[0].script(Script(mode="drop_after", drop_at=2, tokens=5))
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", CHAT_STREAM)
        assert st == 200
        ev = sse_events(body)
        assert ev[-1] == b"[DONE]"
        assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in ev[:2]] == ["tok0 ", "tok1 "]
        err = orjson.loads(ev[2])
        assert err["error"]["code"] == 502
        assert len(ev) == 4
        assert gw.inflight() == 0
    finally:
        await teardown(fbs, gw)


@run_async
async def test_first_byte_timeout_gives_504():
    fbs, gw = await setup(1, timeouts={"first_token_s": 0.3})
    try:
        fbs[0].script(Script(mode="hang"))
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert st == 504 and orjson.loads(out)["error"]["code"] == 504
        await asyncio.sleep(0.1)
        assert fbs[0].log[0].closed_at is not None  # upstream request aborted
        assert gw.inflight() == 0
    finally:
        await teardown(fbs, gw)


@run_async
async def test_idle_timeout_mid_stream_gives_sse_504_event():
    fbs, gw = await setup(1, timeouts={"idle_s": 0.3})
    try:
        fbs[0].script(Script(tokens=3, token_delay_s=2.0))
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", CHAT_STREAM)
        assert st == 200
        ev = sse_events(body)
        assert orjson.loads(ev[0])["choices"][0]["delta"]["content"] == "tok0 "
        assert orjson.loads(ev[1])["error"]["code"] == 504
        assert ev[2:] == [b"[DONE]"]
        assert gw.inflight() == 0
    finally:
        await teardown(fbs, gw)


@run_async
async def test_client_disconnect_mid_stream_aborts_upstream():
    fbs, gw = await setup(1)
    try:
        fbs[0].default = Script(tokens=100, token_delay_s=0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(CHAT_STREAM), CHAT_STREAM))
        await writer.drain()
        got = b""
        while got.count(b"data: ") < 3:
            got += await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        for _ in range(100):
            if fbs[0].log[0].closed_at is not None:
                break
            await asyncio.sleep(0.02)
        assert fbs[0].log[0].closed_at is not None and not fbs[0].log[0].complete
        for _ in range(50):
            if gw.inflight() == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.inflight() == 0
    finally:
        await teardown(fbs, gw)


@run_async
async def test_request_id_and_authorization_forwarded():
    fbs, gw = await setup(1)
    try:
        st, h, _ = await http(gw.port, "POST", "/v1/chat/completions", CHAT,
                              {"x-request-id": "abc-123", "authorization": "Bearer sk-1"})
        assert st == 200 and h["x-request-id"] == "abc-123"
        got = fbs[0].log[0].headers
        assert got["x-request-id"] == "abc-123" and got["authorization"] == "Bearer sk-1"
        st, h, _ = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert len(h["x-request-id"]) >= 16
        assert fbs[0].log[1].headers["x-request-id"] == h["x-request-id"]
    finally:
        await teardown(fbs, gw)


@run_async
async def test_body_over_limit_gets_413():
    fbs, gw = await setup(1, max_body_bytes=4096)
    try:
        st, _, out = await http(gw.port, "POST", "/v1/completions", b'{"prompt":"' + b"x" * 8000 + b'"}')
        assert st == 413 and orjson.loads(out)["error"]["code"] == 413
    finally:
        await teardown(fbs, gw)


@run_async
async def test_models_aggregated_and_readiness():
    fbs, gw = await setup(2, health_check_interval_s=0.05, health_failures=1)
    fbs[1].model = "m2"
    gw.probe = None
    from motor.coordinator.endpoints import StaticBackends
    probe = StaticBackends(gw.table, 0.05, 1.0, 1)
    try:
        for ep in list(gw.table.endpoints.values()):
            await probe.probe(ep)
        st, _, out = await http(gw.port, "GET", "/v1/models")
        assert st == 200
        assert sorted(m["id"] for m in orjson.loads(out)["data"]) == ["m", "m2"]
        st, _, _ = await http(gw.port, "GET", "/readiness")
        assert st == 200
        fbs[0].health_status = 503
        fbs[1].health_status = 503
        for ep in list(gw.table.endpoints.values()):
            await probe.probe(ep)
        st, _, _ = await http(gw.port, "GET", "/readiness")
        assert st == 503
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert st == 503 and orjson.loads(out)["error"]["code"] == 503
    finally:
        probe.close()
        await teardown(fbs, gw)


@run_async
async def test_empty_request_id_is_replaced_by_a_made_up_one():
    fbs, gw = await setup(1)
    try:
        st, h, _ = await http(gw.port, "POST", "/v1/chat/completions", CHAT, {"x-request-id": ""})
        assert st == 200 and len(h["x-request-id"]) >= 16
        assert fbs[0].log[0].headers["x-request-id"] == h["x-request-id"]
    finally:
        await teardown(fbs, gw)
