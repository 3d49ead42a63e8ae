"""B20: max_tokens 0 / -1 -> the engine's 400 (never 500); missing max_tokens is not injected;
max_completion_tokens and max_tokens reach the engine as sent."""
from __future__ import annotations

import orjson
import pytest

from tests.cases.harness import FB, cluster, content, default_behave, events, http, run_async


async def rule(fb, req, resp, e):
    body = orjson.loads(req.body)
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if v is not None and v <= 0:
            resp.send(400, orjson.dumps({"error": {"message": f"{k} must be at least 1, got {v}.",
                                                   "type": "BadRequestError", "param": k, "code": 400}}))
            return
    fb.tokens = 100
    await default_behave(fb, req, resp, e)


def tokens(out: bytes, stream: bool) -> int:
    if stream:
        return len(content(events(out)))
    return len(orjson.loads(out)["choices"][0]["message"]["content"].split())


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_max_tokens_rules(stream):
    async with cluster(fbs=[FB(behave=rule)]) as (fbs, gw):
        base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        for v in (0, -1):
            st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(dict(base, max_tokens=v)))
            assert st == 400 and "max_tokens" in orjson.loads(out)["error"]["message"]
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(base))
        assert st == 200 and "max_tokens" not in fbs[0].log[-1].json and tokens(out, stream) == 100
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions",
                                orjson.dumps(dict(base, max_completion_tokens=7)))
        assert st == 200 and fbs[0].log[-1].json["max_completion_tokens"] == 7 and tokens(out, stream) == 7
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(dict(base, max_tokens=5)))
        assert st == 200 and fbs[0].log[-1].json["max_tokens"] == 5 and tokens(out, stream) == 5
        assert gw.inflight() == 0
