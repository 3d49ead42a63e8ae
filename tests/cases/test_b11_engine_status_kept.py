"""B11: engine 4xx/429 keep their status and message (Retry-After too); 4xx never retried;
429 may be retried elsewhere, and then the client gets that answer."""
from __future__ import annotations

import orjson
import pytest

from tests.cases.harness import FB, cluster, default_behave, events, http, run_async

CASES = {
    400: b'{"error":{"message":"validation failed: messages[0].role","type":"BadRequestError","param":null,"code":400}}',
    401: b'{"error":{"message":"invalid api key"}}',
    404: b'{"error":{"message":"model \'m2\' not found"}}',
    413: b'{"error":{"message":"request too large"}}',
    422: b'{"error":{"message":"unprocessable: bad schema"}}',
    429: b'{"error":{"message":"rate limited"}}',
}


def make(only_first: bool):
    async def behave(fb, req, resp, e):
        body = orjson.loads(req.body)
        text = body["messages"][0]["content"]
        if text.startswith("CASE=") and (fb.name == "A" or not only_first):
            code = int(text[5:])
            resp.send(code, CASES[code], headers=((b"retry-after", b"3"),) if code == 429 else ())
            return
        await default_behave(fb, req, resp, e)
    return behave


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code", [400, 401, 404, 413, 422])
@run_async
async def test_client_errors_pass_through_unretried(code, stream):
    a, b = FB(behave=make(False)), FB(behave=make(False))
    a.name, b.name = "A", "B"
    async with cluster(fbs=[a, b]) as (fbs, gw):
        req = {"model": "m", "messages": [{"role": "user", "content": f"CASE={code}"}], "stream": stream}
        st, h, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        assert st == code                       # not 200 + SSE error, not 500/502
        assert orjson.loads(out)["error"]["message"] == orjson.loads(CASES[code])["error"]["message"]
        assert len(a.log) + len(b.log) == 1     # not retried on the other FB
        assert gw.inflight() == 0


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_429_keeps_retry_after_or_is_answered_by_the_other_fb(stream):
    # both FBs say 429: the client gets 429 with Retry-After
    a, b = FB(behave=make(False)), FB(behave=make(False))
    a.name, b.name = "A", "B"
    req = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "CASE=429"}], "stream": stream})
    async with cluster(fbs=[a, b]) as (fbs, gw):
        st, h, out = await http(gw.port, "POST", "/v1/chat/completions", req)
        assert st == 429 and h["retry-after"] == "3"
        assert orjson.loads(out)["error"]["message"] == "rate limited"
        assert all(ep.breaker.state == 0 for ep in gw.table.endpoints.values())
    # only FB-A says 429: the retry on FB-B answers
    a, b = FB(behave=make(True)), FB(behave=make(True))
    a.name, b.name = "A", "B"
    async with cluster(fbs=[a, b]) as (fbs, gw):
        st, h, out = await http(gw.port, "POST", "/v1/chat/completions", req)
        assert st == 200
        if stream:
            assert events(out)[-1] == b"[DONE]"
        assert len(b.log) == 1
