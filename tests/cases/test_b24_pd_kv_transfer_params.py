"""B24: vLLM-style PD (P-PD-VLLM): kv_transfer_params passed both ways, prompt_logprobs
taken from the prefill, never sent to the decode."""
from __future__ import annotations

import orjson

from motor.config.schema import Role
from tests.cases.harness import FB, cmpl_chunk, chat_chunk, content, run_async, sse, stream, \
    write_events
from tests.support.gateway import Gateway, http

P_KTP = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p1",
         "remote_block_ids": [11, 12, 13], "remote_host": "10.0.0.1", "remote_port": 5600,
         "tp_size": 1}
PLP = [None, {"1": {"logprob": -1.5, "rank": 1, "decoded_token": "x"}}]


async def fb_p(fb, req, resp, e):
    body = orjson.loads(req.body)
    assert body.get("kv_transfer_params", {}).get("do_remote_decode") is True
    chat = e.path == "/v1/chat/completions"
    ch = {"index": 0, "finish_reason": "length"}
    if chat:
        ch["message"] = {"role": "assistant", "content": "P"}
    else:
        ch["text"] = "P"
        if body.get("prompt_logprobs"):
            ch["prompt_logprobs"] = PLP
    resp.send(200, orjson.dumps({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "model": "m", "choices": [ch], "kv_transfer_params": P_KTP,
                                 "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                           "total_tokens": 3}}))


async def fb_d(fb, req, resp, e):
    body = orjson.loads(req.body)
    if "prompt_logprobs" in body:
        resp.send(500, b'{"error":{"message":"decode has no prompt hidden states","type":"x","code":500}}')
        return
    chat = e.path == "/v1/chat/completions"
    if not body.get("stream"):
        resp.send(200, orjson.dumps({"id": "cmpl-d", "object": "text_completion", "model": "m",
                                     "choices": [{"index": 0, "text": "".join(f"D{i}" for i in range(50)),
                                                  "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": 2, "completion_tokens": 50,
                                               "total_tokens": 52}}))
        return
    resp.start(200)
    evs = [sse(chat_chunk(f"D{i}", "length" if i == 49 else None, role=(i == 0)) if chat
               else cmpl_chunk(f"D{i}", "length" if i == 49 else None)) for i in range(50)]
    await write_events(resp, e, evs)
    resp.write(sse({"id": "d", "object": "chat.completion.chunk", "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 50, "total_tokens": 52}}))
    resp.end(b"data: [DONE]\n\n")


@run_async
async def test_pd_kv_transfer_params_and_prompt_logprobs():
    p, d = await FB(behave=fb_p).start(), await FB(behave=fb_d).start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", p.port), (Role.DECODE, "127.0.0.1", d.port)],
                       mode="pd_prefill_first").start()
    try:
        req = {"model": "m", "messages": [{"role": "user", "content": "explain"}], "max_tokens": 50,
               "min_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        st, _, evs, _ = await stream(gw.port, "/v1/chat/completions", orjson.dumps(req),
                                     headers={"x-request-id": "b24"})
        assert st == 200
        pb, db = p.gen()[-1].json, d.gen()[-1].json
        # 1. the prefill leg
        assert pb["stream"] is False and pb["max_tokens"] == 1
        assert "stream_options" not in pb and "min_tokens" not in pb
        assert pb["kv_transfer_params"]["do_remote_decode"] is True
        # 2. the decode leg: the client's fields + P's params verbatim
        for k in ("max_tokens", "min_tokens", "stream", "stream_options", "messages"):
            assert db[k] == req[k]
        assert db["kv_transfer_params"] == P_KTP
        # 3. only D's tokens, one usage chunk
        assert content(evs) == [f"D{i}" for i in range(50)]
        assert sum(1 for x in evs if x != b"[DONE]" and orjson.loads(x).get("usage")) == 1
        # 5. the same X-Request-Id on both legs
        assert p.gen()[-1].headers["x-request-id"] == d.gen()[-1].headers["x-request-id"] == "b24"

        # 4. prompt_logprobs: from P, never sent to D
        req2 = {"model": "m", "prompt": "explain", "max_tokens": 50, "prompt_logprobs": 1}
        st, _, body = await http(gw.port, "POST", "/v1/completions", orjson.dumps(req2))
        assert st == 200, body
        obj = orjson.loads(body)
        assert obj["choices"][0]["prompt_logprobs"] == PLP
        assert "prompt_logprobs" not in d.gen()[-1].json
        assert p.gen()[-1].json["prompt_logprobs"] == 1
        assert gw.inflight() == 0
    finally:
        await gw.stop()
        await p.stop()
        await d.stop()
