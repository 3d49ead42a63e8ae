"""B03: ``stream_options`` (include_usage, continuous_usage_stats) reach the engine as sent,
and the usage chunk reaches the client; usage motor would inject is never shown."""
from __future__ import annotations

import orjson
import pytest

from tests.cases.harness import FB, cluster, events, http, run_async, sse, chat_chunk, cmpl_chunk


async def echo_usage(fb, req, resp, e):
    body = orjson.loads(req.body)
    so = body.get("stream_options") or {}
    chat = e.path.endswith("chat/completions")
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    resp.start(200)
    for i in range(3):
        c = chat_chunk(f"t{i}", "stop" if i == 2 else None) if chat else cmpl_chunk(f"t{i}", None if i < 2 else "stop")
        if body.get("return_token_ids"):
            c["choices"][0]["token_ids"] = [i]
            if i == 0:
                if chat:
                    c["prompt_token_ids"] = [1, 2]
                else:
                    c["choices"][0]["prompt_token_ids"] = [1, 2]
        if so.get("include_usage"):
            c["usage"] = dict(usage, completion_tokens=i + 1, total_tokens=6 + i) \
                if so.get("continuous_usage_stats") else None
        resp.write(sse(c))
    if so.get("include_usage"):
        resp.write(sse({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                        "choices": [], "usage": usage}))
    resp.end(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path,req", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True,
                         "stream_options": {"include_usage": True}}),
])
@run_async
async def test_stream_options_forwarded_and_usage_delivered(path, req):
    async with cluster(fbs=[FB(behave=echo_usage)]) as (fbs, gw):
        st, _, body = await http(gw.port, "POST", path, orjson.dumps(req))
        assert st == 200
        got = fbs[0].log[0].json
        assert got["stream_options"] == req["stream_options"]
        ev = events(body)
        assert ev[-1] == b"[DONE]" and ev.count(b"[DONE]") == 1
        objs = [orjson.loads(x) for x in ev[:-1]]
        assert objs[-1]["choices"] == [] and objs[-1]["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        if req["stream_options"].get("continuous_usage_stats"):
            assert all(o["usage"] is not None for o in objs)
        # token ids motor asked for (failover bookkeeping) are not shown to this client
        assert all("token_ids" not in c and "prompt_token_ids" not in o
                   for o in objs for c in o["choices"])


@run_async
async def test_no_usage_chunk_when_the_client_did_not_ask():
    async with cluster(fbs=[FB(behave=echo_usage)]) as (fbs, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions",
                                 b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}')
        assert st == 200
        assert "stream_options" not in fbs[0].log[0].json
        assert all("usage" not in orjson.loads(x) for x in events(body)[:-1])
