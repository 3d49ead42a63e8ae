"""StreamRecovery with the byte scanner (motor._fast.sse) against StreamRecovery on its JSON
path alone: on any stream of legs, the client gets the same JSON, and the failover sees the
same token ids, state and continuation."""
from __future__ import annotations

import orjson
from hypothesis import HealthCheck, given, settings, strategies as st

from motor.coordinator.recovery import StreamRecovery
from tests.unit._fast.sse_chunks import chat, chunk, cmpl, data, events

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
STATE = ("prompt_ids", "gen", "leg", "leg_is_cmpl", "leg_base", "finished", "finish_reason",
         "done", "recomputed", "engine_error", "engine_error_status", "ids_missing", "blocked",
         "role_sent", "resp_id", "created", "model", "usage_sent")
ODD = [b'data: {"error":{"message":"boom","code":500}}\n\n',
       b'data: {"error":{"message":"too long","code":400}}\n\n',
       b'data: {"id":"x","choices":[{"index":0,"text":"","delta":{},"finish_reason":null,'
       b'"stop_reason":"recomputed"}]}\n\n',
       b"data: [DONE]\n\n", b": keep-alive\n\n", b"data: not json\n\n",
       b'data: {"id":"x","choices":[]}\ndata: [DONE]\n\n',
       b'data: {"id":"y","choices":[{"index":0,"text":"a"},{"index":1,"text":"b"}]}\n\n',
       b"\n\n"]


def state(r: StreamRecovery) -> dict[str, object]:
    return {k: getattr(r, k) for k in STATE} | {"leg_end": r.leg_end(),
                                                 "why_not": r.why_not()}


@st.composite
def legs(draw):
    chat_mode = draw(st.booleans())
    body: dict = {"model": "m", "stream": True, "max_tokens": draw(st.integers(1, 40))}
    body["messages" if chat_mode else "prompt"] = [{"role": "user", "content": "hi"}] \
        if chat_mode else "hi"
    if draw(st.booleans()):
        body["return_token_ids"] = True
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    out = []
    for leg in range(draw(st.integers(1, 3))):
        shape = chat_mode if leg == 0 else False    # continuations are completions
        raw = [data(e, draw(st.booleans()))
               for e in draw(st.lists(chunk(shape), min_size=0, max_size=6))]
        for _ in range(draw(st.integers(0, 2))):
            raw.insert(draw(st.integers(0, len(raw))), draw(st.sampled_from(ODD)))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(raw))), max_size=4)))
        blocks, last = [], 0
        for c in cuts + [len(raw)]:
            if c > last:
                blocks.append(b"".join(raw[last:c]))
                last = c
        out.append(blocks)
    return chat_mode, body, out


@SETTINGS
@given(legs())
def test_the_scanner_changes_nothing_the_failover_or_the_client_sees(case):
    chat_mode, body, legs_ = case
    fast, slow = StreamRecovery(chat_mode, body), StreamRecovery(chat_mode, body, scan=False)
    path = b"/v1/chat/completions" if chat_mode else b"/v1/completions"
    for i, blocks in enumerate(legs_):
        if i:
            assert fast.continuation(path, 4096) == slow.continuation(path, 4096)
        for block in blocks:
            a, b = fast.feed(block), slow.feed(block)
            assert events(a) == events(b), block
            assert state(fast) == state(slow), block
    assert fast.tail_after_finish() == slow.tail_after_finish()


def test_a_vllm_chat_stream_goes_without_the_json_path():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3}
    r = StreamRecovery(True, body)
    first = chat("", None, prompt_token_ids=[1, 2, 3])
    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    out = r.feed(data(first))
    out += r.feed(data(chat("a", [10])) + data(chat("b", [11])))
    out += r.feed(data(chat("c", [12], finish="length")) + b"data: [DONE]\n\n")
    assert r.scanner is not None and r.scanner.fallbacks == 0 and r.scanner.events == 4
    assert r.prompt_ids == [1, 2, 3] and r.gen == [10, 11, 12]
    assert r.leg_end() == "done" and r.finish_reason == "length" and r.resp_id == "chatcmpl-1"
    assert b"token_ids" not in out
    got = events(out)
    assert [e["choices"][0]["delta"].get("content") for e in got[:-1]] == ["", "a", "b", "c"]


def test_a_completion_continues_from_what_the_scanner_recorded():
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 5}
    r = StreamRecovery(False, body)
    r.feed(data(cmpl("a", [10], prompt_ids=[1, 2])) + data(cmpl("b", [11])))
    assert r.leg_end() == "broken"
    path, cont = r.continuation(b"/v1/completions")
    assert path == b"/v1/completions"
    sent = orjson.loads(cont)
    assert sent["prompt"] == [1, 2, 10, 11] and sent["max_tokens"] == 3
    # the continuation's chunks take the JSON path: stamped with the first leg's id
    (e,) = events(r.feed(data(cmpl("c", [12]) | {"id": "cmpl-other"})))
    assert e["id"] == "cmpl-1" and r.gen == [10, 11, 12]
