"""B04: usage on every chunk does not end the stream; trailing bytes without a blank line
are passed on; a finishing chunk without usage is fine."""
from __future__ import annotations

import orjson

from tests.cases.harness import FB, cluster, content, events, http, run_async, sse, chat_chunk

REQ = (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
       b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}}')
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def run_a(fb, req, resp, e):
    resp.start(200)
    for i in range(20):
        c = chat_chunk(f"t{i} ", "stop" if i == 19 else None)
        c["usage"] = {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i}
        resp.write(sse(c))
    resp.write(sse({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}}))
    resp.end(b"data: [DONE]\n\n")


TAIL_B = (b'data: ' + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1,
                                    "model": "m", "choices": [], "usage": USAGE})
          + b'\ndata: [DONE]\n\n')


async def run_b(fb, req, resp, e):
    resp.start(200)
    for i in range(5):
        resp.write(sse(chat_chunk(f"t{i} ", "stop" if i == 4 else None)))
    resp.end(TAIL_B)


async def run_c(fb, req, resp, e):
    resp.start(200)
    for i in range(5):
        resp.write(sse(chat_chunk(f"t{i} ", "stop" if i == 4 else None)))
    resp.end(b"data: [DONE]\n\n")


@run_async
async def test_a_usage_in_every_chunk_does_not_end_the_stream():
    async with cluster(fbs=[FB(behave=run_a)]) as (fbs, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200
        ev = events(body)
        assert content(ev) == [f"t{i} " for i in range(20)]
        assert ev.count(b"[DONE]") == 1 and ev[-1] == b"[DONE]"


@run_async
async def test_b_trailing_bytes_reach_the_client_unchanged():
    async with cluster(fbs=[FB(behave=run_b)]) as (fbs, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200
        assert body.endswith(TAIL_B)
        assert body.count(b"[DONE]") == 1
        assert content(events(body)[:5]) == [f"t{i} " for i in range(5)]


@run_async
async def test_c_final_chunk_without_usage_is_fine():
    async with cluster(fbs=[FB(behave=run_c)]) as (fbs, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200
        ev = events(body)
        assert content(ev) == [f"t{i} " for i in range(5)]
        assert ev[-1] == b"[DONE]" and b"error" not in body
