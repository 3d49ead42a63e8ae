"""B15: X-Request-Id honoured and propagated; made up when absent; oversized ones refused."""
from __future__ import annotations

import asyncio

import orjson

from tests.cases.harness import cluster, http, run_async

REQ = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


@run_async
async def test_request_id_round_trip():
    async with cluster(1) as (fbs, gw):
        st, h, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, {"x-request-id": "rid-abc-123"})
        assert st == 200 and h["x-request-id"] == "rid-abc-123"
        assert fbs[0].log[0].headers["x-request-id"] == "rid-abc-123"
        (s1, h1, _), (s2, h2, _) = await asyncio.gather(
            http(gw.port, "POST", "/v1/chat/completions", REQ),
            http(gw.port, "POST", "/v1/chat/completions", REQ))
        assert h1["x-request-id"] and h2["x-request-id"] and h1["x-request-id"] != h2["x-request-id"]
        sent = {e.headers["x-request-id"] for e in fbs[0].log[1:]}
        assert sent == {h1["x-request-id"], h2["x-request-id"]}
        # streams carry it too
        st, h, _ = await http(gw.port, "POST", "/v1/chat/completions",
                              REQ[:-1] + b',"stream":true}', {"x-request-id": "rid-s"})
        assert h["x-request-id"] == "rid-s" and fbs[0].log[-1].headers["x-request-id"] == "rid-s"


@run_async
async def test_oversized_request_id_is_refused():
    async with cluster(1) as (fbs, gw):
        st, h, out = await http(gw.port, "POST", "/v1/chat/completions", REQ, {"x-request-id": "r" * 1_000_000})
        assert st in (400, 431)
        assert orjson.loads(out)["error"]["code"] == st
        assert len(out) < 1000 and fbs[0].log == []
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200                      # still healthy
