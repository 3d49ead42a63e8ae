"""N02: ``Expect: 100-continue`` is answered before the body (RFC 9110 section 10.1.1), an
oversize body gets its 413 without being uploaded, an unknown expectation gets 417, the
engine never sees ``Expect``, and curl's own large upload does not wait for an interim
answer that never comes."""
from __future__ import annotations

import asyncio
import hashlib

import orjson

from tests.cases.harness import FB, cluster, default_behave, run_async


async def echo_sha(fb, req, resp, e):
    if req.path == "/v1/chat/completions":
        resp.send(200, orjson.dumps({"sha256": hashlib.sha256(req.body).hexdigest(),
                                     "expect": req.header(b"expect") is not None}))
        return
    await default_behave(fb, req, resp, e)


def body_of(n: int) -> bytes:
    pad = n - len(b'{"model":"m","messages":[{"role":"user","content":""}]}')
    return b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * pad + b'"}]}'


async def head_only(port: int, length: int, expect: str) -> tuple[asyncio.StreamReader,
                                                                   asyncio.StreamWriter, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            f"\r\ncontent-length: {length}\r\nexpect: {expect}\r\n\r\n".encode())
    await w.drain()
    first = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3.0)
    return r, w, first


async def read_answer(r: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10.0)
    status = int(head.split()[1])
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                  if ln.lower().startswith(b"content-length"))
    return status, await r.readexactly(length)


@run_async
async def test_continue_then_body_then_the_engines_answer():
    body = body_of(2_000_000)
    async with cluster(fbs=[FB(behave=echo_sha)]) as (fbs, gw):
        for token in ("100-continue", "100-Continue"):
            r, w, first = await head_only(gw.port, len(body), token)
            assert first == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(body)
            await w.drain()
            status, out = await read_answer(r)
            assert status == 200
            doc = orjson.loads(out)
            assert doc["sha256"] == hashlib.sha256(body).hexdigest()
            assert doc["expect"] is False              # not forwarded to the engine
            w.close()
        assert len(fbs[0].log) == 2


@run_async
async def test_oversize_body_is_refused_before_it_is_sent():
    async with cluster(fbs=[FB(behave=echo_sha)], max_body_bytes=1024 * 1024) as (fbs, gw):
        r, w, first = await head_only(gw.port, 1024 * 1024 + 1, "100-continue")
        assert first.startswith(b"HTTP/1.1 413 ")
        assert b"connection: close" in first.lower()
        w.close()
        assert fbs[0].log == []
        # a fresh connection is served
        r, w, first = await head_only(gw.port, len(body_of(100)), "100-continue")
        w.write(body_of(100))
        assert (await read_answer(r))[0] == 200
        w.close()


@run_async
async def test_unknown_expectation_is_417():
    async with cluster(fbs=[FB(behave=echo_sha)]) as (fbs, gw):
        r, w = await asyncio.open_connection("127.0.0.1", gw.port)
        body = body_of(10_000)
        w.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                f"{len(body)}\r\nexpect: x-unknown\r\n\r\n".encode() + body)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 417 ")
        w.close()
        assert fbs[0].log == []


@run_async
async def test_curl_large_upload_gets_its_continue(tmp_path):
    body = body_of(2_000_000)
    f = tmp_path / "2mb.json"
    f.write_bytes(body)
    async with cluster(fbs=[FB(behave=echo_sha)]) as (_fbs, gw):
        # curl sends Expect: 100-continue for this body and waits up to 30 s for the interim
        # answer before uploading anyway: within --max-time 10 only when it is answered
        p = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "10", "--expect100-timeout", "30",
            "-H", "content-type: application/json", "-H", "expect: 100-continue",
            "--data-binary", f"@{f}", f"http://127.0.0.1:{gw.port}/v1/chat/completions",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await p.communicate()
        assert p.returncode == 0, out
        assert orjson.loads(out)["sha256"] == hashlib.sha256(body).hexdigest()


async def expect_with_key(port: int, body: bytes, key: str) -> bytes:
    """Headers with ``Expect: 100-continue`` and ``key``; the body only after a ``100``. The
    final answer's head, prefixed ``100+`` when a ``100 Continue`` came first."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
            f"{len(body)}\r\nauthorization: Bearer {key}\r\n"
            f"expect: 100-continue\r\n\r\n".encode())
    first = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3.0)
    if first.startswith(b"HTTP/1.1 100"):
        w.write(body)
        first = b"100+" + await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5.0)
    w.close()
    return first


@run_async
async def test_a_refused_key_or_limit_is_answered_instead_of_the_continue():
    async with cluster(fbs=[FB(behave=echo_sha)], api_keys=[{"name": "a", "key": "sk-a"}],
                       limits={"keys": {"a": {"rpm": 60}}}) as (fbs, gw):
        body = body_of(100_000)

        async def expect(key: str) -> bytes:
            return await expect_with_key(gw.port, body, key)
        assert (await expect("sk-wrong")).startswith(b"HTTP/1.1 401 ")   # no 100 first
        assert (await expect("sk-a")).startswith(b"100+HTTP/1.1 200 ")   # 100, body, 200
        refused = await expect("sk-a")                                    # rpm 60: burst of 1
        assert refused.startswith(b"HTTP/1.1 429 ") and b"retry-after:" in refused.lower()
        assert len(fbs[0].log) == 1


@run_async
async def test_a_wrong_key_already_refused_gets_no_continue_with_hashed_keys():
    from motor.coordinator.keys import hash_key
    async with cluster(fbs=[FB(behave=echo_sha)],
                       api_keys=[{"name": "h", "key": hash_key("sk-h", iterations=1000)}]
                       ) as (fbs, gw):
        body = body_of(10_000)

        async def expect(key: str) -> bytes:
            return await expect_with_key(gw.port, body, key)
        # the first time, only a derivation can tell: the body comes, then the 401
        assert (await expect("sk-wrong")).startswith(b"100+HTTP/1.1 401 ")
        # known to be wrong now: 401 instead of the 100
        assert (await expect("sk-wrong")).startswith(b"HTTP/1.1 401 ")
        assert (await expect("sk-h")).startswith(b"100+HTTP/1.1 200 ")
        assert len(fbs[0].log) == 1
