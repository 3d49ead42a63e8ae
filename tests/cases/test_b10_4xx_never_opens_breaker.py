"""B10: a client's 4xx from a healthy engine never opens its breaker nor is retried."""
from __future__ import annotations

import orjson

from tests.cases.harness import FB, cluster, default_behave, http, run_async

ERR = orjson.dumps({"error": {"message": "This model's maximum context length is 4096 tokens. However, "
                              "you requested 100005 tokens.", "type": "BadRequestError", "param": None,
                              "code": 400}})


async def behave(fb, req, resp, e):
    if b"OVERSIZE" in req.body:
        resp.send(400, ERR)
        return
    await default_behave(fb, req, resp, e)


@run_async
async def test_oversize_400s_pass_through_and_workers_stay_in_rotation():
    async with cluster(fbs=[FB(behave=behave), FB(behave=behave)]) as (fbs, gw):
        bad = b'{"model":"m","messages":[{"role":"user","content":"OVERSIZE ' + b"x" * 100 + b'"}],"max_tokens":100000}'
        for _ in range(30):
            st, _, out = await http(gw.port, "POST", "/v1/chat/completions", bad)
            assert st == 400 and out == ERR
        assert sum(len(fb.log) for fb in fbs) == 30   # each reached an FB exactly once
        for _ in range(10):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                                  b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
            assert st == 200
        assert all(len([x for x in fb.log if b"OVERSIZE" not in x.body]) >= 2 for fb in fbs)
        assert all(ep.breaker.state == 0 and ep.failures == 0 for ep in gw.table.endpoints.values())
        assert gw.inflight() == 0
