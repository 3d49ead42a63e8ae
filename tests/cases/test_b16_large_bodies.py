"""B16: large prompts / base64 images pass (default limit 64 MiB, configurable); a body over
the limit gets 413 with a JSON error before it is read, and the engine receives nothing."""
from __future__ import annotations

import asyncio
import hashlib

import orjson

from motor.config.schema import CoordinatorConfig
from tests.cases.harness import FB, cluster, http, run_async


async def echo_sha(fb, req, resp, e):
    msg = orjson.dumps({"received_sha256": hashlib.sha256(req.body).hexdigest(), "bytes": len(req.body)})
    resp.send(200, orjson.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                 "choices": [{"index": 0, "message": {"role": "assistant",
                                                                      "content": msg.decode()},
                                              "finish_reason": "stop"}]}))


async def announce(port: int, n: int) -> bytes:
    """Announce an ``n``-byte body, send its first 64 KiB, return what the gateway answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % n + b"x" * 65536)
    try:
        await writer.drain()
    except ConnectionError:
        pass
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return raw


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@run_async
async def test_large_bodies_pass_verbatim_and_oversize_is_413():
    assert CoordinatorConfig().max_body_bytes == 64 * 1024 * 1024   # the documented default
    async with cluster(fbs=[FB(behave=echo_sha)]) as (fbs, gw):
        bodies = [
            ("/v1/chat/completions", orjson.dumps({"model": "m", "messages": [
                {"role": "user", "content": "a" * 6_000_000}]})),
            ("/v1/chat/completions", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "describe"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 5_000_000}}]}]})),
            ("/v1/completions", orjson.dumps({"model": "m", "prompt": ["p" * 200_000] * 64})),
        ]
        for path, body in bodies:
            st, _, out = await http(gw.port, "POST", path, body, timeout=30)
            assert st == 200
            got = orjson.loads(orjson.loads(out)["choices"][0]["message"]["content"])
            assert got == {"received_sha256": sha(body), "bytes": len(body)}
        # 700 MB announced and streamed: refused at the headers, engine never sees it
        raw = await announce(gw.port, 734003200)
        assert raw.startswith(b"HTTP/1.1 413")
        assert orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413
        assert len(fbs[0].log) == 3
        st, _, _ = await http(gw.port, "POST", "/v1/completions", b'{"model":"m","prompt":"x"}')
        assert st == 200


@run_async
async def test_limit_is_configurable():
    body = orjson.dumps({"model": "m", "prompt": "z" * 2_000_000})
    async with cluster(fbs=[FB(behave=echo_sha)], max_body_bytes=1024 * 1024) as (fbs, gw):
        raw = await announce(gw.port, len(body))
        assert raw.startswith(b"HTTP/1.1 413") and fbs[0].log == []
    async with cluster(fbs=[FB(behave=echo_sha)], max_body_bytes=4 * 1024 * 1024) as (fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/completions", body)
        assert st == 200


@run_async
async def test_a_whole_upload_over_the_limit_reads_its_413_not_a_reset():
    """A client that sends a body over the limit in full, without Expect, reads the 413 and
    then the end of the connection: the gateway shuts its side and drops the rest of the
    upload (a close with the upload unread would reset the connection, and a reset can
    destroy the answer before it is read)."""
    async with cluster(fbs=[FB(behave=echo_sha)], max_body_bytes=65536) as (fbs, gw):
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            body = b"x" * (4 * 1024 * 1024)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            try:
                await writer.drain()
            except ConnectionError:
                pass
            raw = await asyncio.wait_for(reader.read(-1), 10)   # ConnectionResetError: failed
            writer.close()
            assert raw.startswith(b"HTTP/1.1 413 "), raw[:200]
            assert b"larger than the limit" in raw
        assert not fbs[0].log                   # nothing of it reached the engine
