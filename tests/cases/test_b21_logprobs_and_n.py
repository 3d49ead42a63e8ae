"""B21: logprob fields and n > 1 choices pass unchanged (SGLang /generate too)."""
from __future__ import annotations

import orjson

from tests.cases.harness import CHAT_OBJ, FB, cluster, events, http, run_async, sse

GEN = [{"text": "x", "meta_info": {"input_token_logprobs": [[-0.1 * i, 100 + i, None] for i in range(6)],
                                   "output_token_logprobs": [[-0.5, 7, None]],
                                   "input_top_logprobs": [[[-0.1, 100 + i, None]] for i in range(6)],
                                   "output_top_logprobs": [[[-0.5, 7, None]]]}}]


def lp(tok: int) -> dict:
    return {"token": f"t{tok}", "logprob": -0.1 * tok, "bytes": [116],
            "top_logprobs": [{"token": f"a{j}", "logprob": -j * 1.0, "bytes": [97]} for j in range(5)]}


CHAT_N = dict(CHAT_OBJ, choices=[{"index": i, "message": {"role": "assistant", "content": "abcd"},
                                  "logprobs": {"content": [lp(t) for t in range(4)]},
                                  "finish_reason": "length"} for i in range(3)],
              usage={"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17})
CMPL = {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
    {"index": i, "text": "hi there", "finish_reason": "length",
     "logprobs": {"tokens": ["hi", " there"], "token_logprobs": [None, -0.3],
                  "top_logprobs": [None, {" there": -0.3, " x": -2.0}], "text_offset": [0, 2]}}
    for i in range(2)]}
ORDER = [2, 0, 1, 1, 2, 0, 0, 1, 2]


async def behave(fb, req, resp, e):
    body = orjson.loads(req.body)
    if e.path == "/generate":
        resp.send(200, orjson.dumps(GEN))
    elif e.path == "/v1/completions":
        resp.send(200, orjson.dumps(CMPL))
    elif body.get("stream"):
        resp.start(200)
        for k, i in enumerate(ORDER):
            resp.write(sse(dict(CHAT_OBJ, object="chat.completion.chunk", choices=[
                {"index": i, "delta": {"content": f"{i}{k}"}, "logprobs": {"content": [lp(k)]},
                 "finish_reason": None}])))
        resp.end(b"data: [DONE]\n\n")
    else:
        resp.send(200, orjson.dumps(CHAT_N))


@run_async
async def test_logprobs_and_choices_pass_unchanged():
    async with cluster(fbs=[FB(behave=behave)]) as (fbs, gw):
        req1 = {"input_ids": [[128000, 3923, 892, 374, 433, 30]], "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 1}
        st, _, out = await http(gw.port, "POST", "/generate", orjson.dumps(req1))
        assert st == 200 and orjson.loads(out) == GEN
        assert fbs[0].log[-1].json == req1
        req2 = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                "top_logprobs": 5, "n": 3, "max_tokens": 4}
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req2))
        assert st == 200 and orjson.loads(out) == CHAT_N
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(dict(req2, stream=True)))
        assert st == 200
        assert fbs[0].log[-1].json == dict(req2, stream=True)   # n>1: not continuable, nothing injected
        objs = [orjson.loads(x) for x in events(out)[:-1]]
        assert [o["choices"][0]["index"] for o in objs] == ORDER
        assert [o["choices"][0]["logprobs"] for o in objs] == [{"content": [lp(k)]} for k in range(len(ORDER))]
        req4 = {"model": "m", "prompt": "hi", "logprobs": 2, "echo": True, "n": 2, "best_of": 3}
        st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(req4))
        assert st == 200 and orjson.loads(out) == CMPL
        assert fbs[0].log[-1].json == req4
