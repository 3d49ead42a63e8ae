"""B19: engine extension fields pass both ways unchanged (request and response, every chunk)."""
from __future__ import annotations

import orjson
import pytest

from tests.cases.harness import CHAT_OBJ, FB, cluster, events, http, run_async, sse, chat_chunk

REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
       "chat_template_kwargs": {"enable_thinking": False}, "top_k": 20, "min_p": 0.05,
       "repetition_penalty": 1.1, "ignore_eos": False, "skip_special_tokens": False,
       "separate_reasoning": True, "return_token_ids": True, "x_vendor_extension": {"a": [1, 2, {"b": None}]}}


async def vendor(fb, req, resp, e):
    body = orjson.loads(req.body)
    if body.get("stream"):
        resp.start(200)
        for i in range(3):
            c = chat_chunk(f"t{i}", "stop" if i == 2 else None, token_ids=[i], matched_stop=None)
            if i == 0:
                c["prompt_token_ids"] = [9, 9]
            resp.write(sse(c))
        resp.end(b"data: [DONE]\n\n")
        return
    resp.send(200, orjson.dumps(dict(CHAT_OBJ, prompt_token_ids=[9, 9], choices=[{
        "index": 0, "message": {"role": "assistant", "content": "x", "reasoning_content": "r"},
        "finish_reason": "stop", "token_ids": [1, 2, 3], "matched_stop": None}])))


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_extension_fields_pass_both_ways(stream):
    async with cluster(fbs=[FB(behave=vendor)]) as (fbs, gw):
        req = dict(REQ, stream=True) if stream else REQ
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        assert st == 200
        got = fbs[0].log[0].json
        for k, v in req.items():
            assert got[k] == v
        if stream:
            objs = [orjson.loads(x) for x in events(out)[:-1]]
            assert [o["choices"][0]["token_ids"] for o in objs] == [[0], [1], [2]]
            assert objs[0]["prompt_token_ids"] == [9, 9]
            assert all("matched_stop" in o["choices"][0] for o in objs)
        else:
            o = orjson.loads(out)
            assert o["prompt_token_ids"] == [9, 9]
            c = o["choices"][0]
            assert c["token_ids"] == [1, 2, 3] and c["message"]["reasoning_content"] == "r"
            assert "matched_stop" in c

