"""B26: no internal queueing at ~100 upstream connections; health answers under load; the
upstream pool falls back afterwards (scaled: 300 streams, 2 FBs)."""
from __future__ import annotations

import asyncio

from tests.cases.harness import FB, cluster, events, http, run_async, wait_for

N = 300


@run_async
async def test_many_concurrent_streams_are_not_queued():
    hold = asyncio.Event()

    async def held(fb, req, resp, e):
        resp.start(200)
        resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n')
        await hold.wait()
        resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n')
        resp.end(b"data: [DONE]\n\n")

    async with cluster(fbs=[FB(behave=held), FB(behave=held)]) as (fbs, gw):
        body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}'
        reqs = [asyncio.ensure_future(http(gw.port, "POST", "/v1/chat/completions", body, timeout=30))
                for _ in range(N)]
        assert await wait_for(lambda: sum(fb.open_requests for fb in fbs) >= N - 2, 20)
        for _ in range(5):
            st, _, _ = await asyncio.wait_for(http(gw.port, "GET", "/health"), 1.0)
            assert st == 200
        hold.set()
        res = await asyncio.gather(*reqs)
        assert all(st == 200 and events(b)[-1] == b"[DONE]" for st, _, b in res)
        assert gw.inflight() == 0
        pools = [ep.pool for ep in gw.table.endpoints.values()]
        assert all(p.open_connections == p.idle_connections for p in pools)   # nothing leaked busy
