"""N04: an in-band SSE error with a 4xx code (a 200 stream whose only event is the engine's
``{"error": {..., "code": 400}}``) is the client's error: passed on unchanged with exactly one
``[DONE]``, never re-sent to another engine, never counted against an engine's breaker. A
5xx in-band error before any content may be re-dispatched once, and the client then gets
that engine's stream. Both engine flavours: SGLang-like (no token ids) and vLLM-like
(``return_token_ids`` honoured)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from motor.coordinator.breaker import CLOSED
from tests.cases.harness import FB, cluster, content, default_behave, run_async, sse, stream

OVERSIZE_ERROR = {"object": "error", "message": "Requested token count exceeds the model's "
                  "maximum context length of 4096 tokens.", "type": "BadRequestError",
                  "param": None, "code": 400}
DEAD_ERROR = {"object": "error", "message": "engine dead", "type": "EngineDeadError",
              "param": None, "code": 503}


def flavour(ids: bool, error: dict | None):
    async def behave(fb, req, resp, e):
        body = orjson.loads(req.body)
        if error is not None and b"OVERSIZE" in req.body:
            resp.start(200)
            resp.write(sse({"error": error}))
            resp.end(b"data: [DONE]\n\n")
            return
        if not ids:
            body.pop("return_token_ids", None)
            req.body = orjson.dumps(body)
        await default_behave(fb, req, resp, e)
    return behave


def oversize() -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "OVERSIZE " * 50}],
                         "stream": True, "max_tokens": 100})


NORMAL = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "max_tokens": 10})


@pytest.mark.parametrize("ids", [False, True], ids=["sglang_like", "vllm_like"])
@run_async
async def test_inband_400_passed_on_not_retried(ids):
    fbs = [FB(behave=flavour(ids, OVERSIZE_ERROR), tokens=10) for _ in range(2)]
    async with cluster(fbs=fbs) as (fbs, gw):
        for _ in range(6):
            st, _, payloads, _ = await stream(gw.port, "/v1/chat/completions", oversize())
            assert st == 200
            assert payloads == [orjson.dumps({"error": OVERSIZE_ERROR}), b"[DONE]"]
        oversized = [e for fb in fbs for e in fb.log if b"OVERSIZE" in e.body]
        assert len(oversized) == 6                     # each reached exactly one engine
        for ep in gw.table.endpoints.values():
            assert ep.breaker.state == CLOSED and ep.failures == 0

        async def normal() -> list[str]:
            st, _, payloads, _ = await stream(gw.port, "/v1/chat/completions", NORMAL)
            assert st == 200 and payloads[-1] == b"[DONE]"
            return content(payloads)
        for _ in range(10):
            pieces = await asyncio.gather(normal(), normal())
            assert all(len(p) == 10 for p in pieces)
        counts = [sum(1 for e in fb.log if b"OVERSIZE" not in e.body) for fb in fbs]
        assert sum(counts) == 20 and all(8 <= c <= 12 for c in counts), counts
        for ep in gw.table.endpoints.values():
            assert ep.breaker.state == CLOSED and ep.failures == 0


@run_async
async def test_inband_503_before_content_redispatched_once():
    a = FB(behave=flavour(True, DEAD_ERROR), tokens=10)
    b = FB(behave=flavour(True, None), tokens=10)
    async with cluster(fbs=[a, b]) as (fbs, gw):
        for _ in range(2):       # round robin: at least one starts on the dead-error engine
            st, _, payloads, _ = await stream(gw.port, "/v1/chat/completions", oversize())
            assert st == 200 and payloads[-1] == b"[DONE]"
            assert b'"error"' not in b"".join(payloads)
            assert len(content(payloads)) == 100          # b's whole stream, max_tokens 100
        # every request a took went on to b once (one re-dispatch each), b served each request
        assert 1 <= len(a.log) <= 2 and len(b.log) == 2
