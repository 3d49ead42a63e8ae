"""The OpenAI-compatible API of the simulator, over HTTP, against vLLM's shapes."""
from __future__ import annotations

import json
import socket

from .helpers import get_json, post_json, request, stream_events, wait_until


def _completion(sim, **body):
    body.setdefault("model", "motor-sim")
    status, data = post_json(sim.port, "/v1/completions", body)
    assert status == 200, data
    return data


def test_completion_non_stream_shape(sim):
    d = _completion(sim, prompt="hello", max_tokens=5)
    assert d["id"].startswith("cmpl-") and d["object"] == "text_completion"
    assert d["model"] == "motor-sim" and isinstance(d["created"], int)
    (c,) = d["choices"]
    assert c["index"] == 0 and len(c["text"]) == 5 and c["logprobs"] is None
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    u = d["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (5, 5, 10)
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_default_max_tokens_is_vllms_16(sim):
    d = _completion(sim, prompt="default length")
    assert d["usage"]["completion_tokens"] == 16


def test_chat_non_stream_shape(sim):
    status, d = post_json(sim.port, "/v1/chat/completions", {
        "model": "motor-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 200, d
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    (c,) = d["choices"]
    assert c["message"]["role"] == "assistant" and len(c["message"]["content"]) == 4
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    assert d["usage"]["prompt_tokens"] == 21 and d["usage"]["completion_tokens"] == 4


def test_chat_max_completion_tokens_and_content_parts(sim):
    status, d = post_json(sim.port, "/v1/chat/completions", {
        "model": "motor-sim", "max_completion_tokens": 3, "max_tokens": 50,
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert status == 200, d
    assert d["usage"]["completion_tokens"] == 3
    # the system message adds <|im_start|> system \n s <|im_end|> \n = 1 + 6 + 1 + 1 + 1 + 1
    assert d["usage"]["prompt_tokens"] == 21 + 11


def test_completion_stream_chunks_usage_and_done(sim):
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "model": "motor-sim", "prompt": "hello", "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and done
    *chunks, last = events
    assert len(chunks) == 6
    for c in chunks:
        assert c["object"] == "text_completion" and c["usage"] is None
        (ch,) = c["choices"]
        assert len(ch["text"]) == 1 and ch["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 6 and last["usage"]["prompt_tokens"] == 5
    assert len({c["id"] for c in events}) == 1


def test_chat_stream_role_first_and_continuous_usage(sim):
    status, events, done = stream_events(sim.port, "/v1/chat/completions", {
        "model": "motor-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200 and done
    first, *toks, last = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (first["usage"]["completion_tokens"], first["usage"]["total_tokens"]) == (0, 21)
    assert len(toks) == 3
    for k, c in enumerate(toks, 1):
        assert c["usage"]["completion_tokens"] == k and c["usage"]["prompt_tokens"] == 21
        assert "role" not in c["choices"][0]["delta"]
    assert toks[-1]["choices"][0]["finish_reason"] == "length"
    assert toks[-1]["choices"][0]["stop_reason"] is None
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 24


def test_n2_stream_interleaved_and_non_stream(sim):
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "abc", "max_tokens": 4, "n": 2, "stream": True})
    assert status == 200 and done
    by_index: dict[int, str] = {0: "", 1: ""}
    for e in events:
        (c,) = e["choices"]
        by_index[c["index"]] += c["text"]
    assert len(by_index[0]) == len(by_index[1]) == 4
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    d = _completion(sim, prompt="abc", max_tokens=4, n=2)
    assert [c["index"] for c in d["choices"]] == [0, 1]
    assert d["usage"]["completion_tokens"] == 8 and d["usage"]["prompt_tokens"] == 3


def test_stop_strings_non_stream_and_stream(sim):
    ref = _completion(sim, prompt="stop test", max_tokens=40, seed=11)["choices"][0]["text"]
    stop = ref[15:18]
    want = ref[:ref.find(stop)]
    d = _completion(sim, prompt="stop test", max_tokens=40, seed=11, stop=[stop, "\u2603"])
    c = d["choices"][0]
    assert c["text"] == want and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "stop test", "max_tokens": 40, "seed": 11, "stop": stop, "stream": True})
    assert done
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop


def test_seed_makes_output_deterministic(sim):
    a = _completion(sim, prompt="same", max_tokens=20, seed=5)["choices"][0]["text"]
    b = _completion(sim, prompt="same", max_tokens=20, seed=5)["choices"][0]["text"]
    c = _completion(sim, prompt="same", max_tokens=20, seed=6)["choices"][0]["text"]
    assert a == b != c


def test_return_token_ids_completions_and_chat(sim):
    d = _completion(sim, prompt="hello", max_tokens=5, return_token_ids=True)
    c = d["choices"][0]
    assert c["prompt_token_ids"] == list(b"hello") and bytes(c["token_ids"]).decode() == c["text"]
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "hello", "max_tokens": 3, "stream": True, "return_token_ids": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == list(b"hello")
    assert all(len(e["choices"][0]["token_ids"]) == 1 for e in events)
    status, events, done = stream_events(sim.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "return_token_ids": True})
    assert len(events[0]["prompt_token_ids"]) == 21
    assert all("prompt_token_ids" not in e for e in events[1:])
    ids = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    text = "".join(e["choices"][0]["delta"]["content"] for e in events[1:])
    assert bytes(ids).decode() == text and len(ids) == 3
    status, d = post_json(sim.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True})
    assert len(d["prompt_token_ids"]) == 21 and len(d["choices"][0]["token_ids"]) == 3


def test_prompt_forms(sim):
    d = _completion(sim, prompt=[104, 105], max_tokens=2)
    assert d["usage"]["prompt_tokens"] == 2
    d = _completion(sim, prompt=["a", "bb"], max_tokens=2)
    assert [c["index"] for c in d["choices"]] == [0, 1] and d["usage"]["prompt_tokens"] == 3
    d = _completion(sim, prompt=[[1, 2, 3], [4]], max_tokens=2, n=2)
    assert [c["index"] for c in d["choices"]] == [0, 1, 2, 3]
    assert d["usage"]["prompt_tokens"] == 4 and d["usage"]["completion_tokens"] == 8


def test_prefix_cache_cached_tokens_on_repeat(sim):
    prompt = "prefix-cache test prompt " * 4  # 100 bytes -> 6 full blocks of 16 can hit
    assert len(prompt) == 100
    a = _completion(sim, prompt=prompt, max_tokens=2)
    b = _completion(sim, prompt=prompt, max_tokens=2)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    st = get_json(sim.port, "/admin/stats")
    assert st["prefix_cache_hits"] >= 96


def test_request_id_header_echoed(sim):
    status, headers, body = request(sim.port, "POST", "/v1/completions",
                                    {"prompt": "x", "max_tokens": 1},
                                    headers={"X-Request-Id": "my-req-1"})
    assert status == 200 and headers["x-request-id"] == "my-req-1"
    assert json.loads(body)["id"] == "cmpl-my-req-1"
    status, headers, body = request(sim.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert json.loads(body)["id"] == "cmpl-" + headers["x-request-id"]


def test_unknown_and_vllm_extension_fields_are_ignored(sim):
    d = _completion(sim, prompt="x", max_tokens=2, temperature=0.3, top_k=5, priority=0,
                    kv_transfer_params=None, skip_special_tokens=True, whatever={"a": 1})
    assert d["usage"]["completion_tokens"] == 2


def _error(sim, path, body=None, raw=None):
    status, headers, data = request(sim.port, "POST", path, body, raw=raw)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return status, err


def test_validation_errors(sim):
    assert _error(sim, "/v1/completions", raw=b"{bad json")[0] == 400
    assert _error(sim, "/v1/chat/completions", raw=b"[1, 2]")[0] == 400
    status, err = _error(sim, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and err["type"] == "NotFoundError" and "nope" in err["message"]
    assert _error(sim, "/v1/completions", {"model": "motor-sim"})[0] == 400
    assert _error(sim, "/v1/chat/completions", {"model": "motor-sim"})[0] == 400
    assert _error(sim, "/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
    status, err = _error(sim, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and "at least 1" in err["message"]
    assert _error(sim, "/v1/completions", {"prompt": "x", "n": 0})[0] == 400
    status, err = _error(sim, "/v1/completions", {"prompt": "x" * 5000})
    assert status == 400 and "maximum context length" in err["message"]
    assert _error(sim, "/v1/completions", {"prompt": "x" * 4000, "max_tokens": 200})[0] == 400
    assert _error(sim, "/v1/completions", {"prompt": [1, 99999]})[0] == 400
    assert _error(sim, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})[0] == 400
    assert _error(sim, "/v1/completions", {"prompt": "x", "stop": 5})[0] == 400


def test_sampling_ranges_like_vllm(sim):
    """vLLM's SamplingParams range checks (vllm/sampling_params.py) give the same 400s."""
    for field, value, text in (
            ("temperature", -0.5, "temperature must be non-negative, got -0.5."),
            ("temperature", 2.5, "temperature must be in [0, 2], got 2.5."),
            ("top_p", 0, "top_p must be in (0, 1], got 0.0."),
            ("top_p", 1.5, "top_p must be in (0, 1], got 1.5."),
            ("top_k", -2, "top_k must be 0 (disable), or at least 1, got -2."),
            ("min_p", 1.1, "min_p must be in [0, 1], got 1.1."),
            ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3.0."),
            ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2], got -2.5."),
            ("repetition_penalty", 0, "repetition_penalty must be greater than zero, got 0.0."),
            ("temperature", "hot", "temperature: Input should be a valid number, got 'hot'"),
            ("top_p", False, "top_p must be in (0, 1], got 0.0."),       # pydantic lax: 0.0
            ("temperature", "nan", "temperature must be a finite number, got nan."),
            ("n", 2, "n must be 1 when using greedy sampling, got 2.")):
        extra = {"temperature": 0} if field == "n" else {}
        for path, base in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}]})):
            status, err = _error(sim, path, {**base, "max_tokens": 2, field: value, **extra})
            assert (status, err["message"], err["param"]) == (400, text, field), (path, field)
    # the edges vLLM accepts
    for field, value in (("temperature", 0), ("temperature", 2), ("top_p", 1), ("top_k", -1),
                         ("top_k", 0), ("min_p", 0), ("presence_penalty", -2),
                         ("repetition_penalty", 2.0), ("temperature", None),
                         ("temperature", "0.5"), ("temperature", True)):
        _completion(sim, prompt="x", max_tokens=2, **{field: value})
    # greedy with one choice, sampling with two
    _completion(sim, prompt="x", max_tokens=2, temperature=0, n=1)
    _completion(sim, prompt="x", max_tokens=2, temperature=0.01, n=2)


def test_models_health_version_metrics(sim):
    m = get_json(sim.port, "/v1/models")
    assert m["object"] == "list"
    (card,) = m["data"]
    assert card["id"] == "motor-sim" and card["owned_by"] == "vllm" and card["max_model_len"] == 4096
    status, _, body = request(sim.port, "GET", "/health")
    assert status == 200 and body == b""
    assert get_json(sim.port, "/version")["version"]
    _completion(sim, prompt="metrics", max_tokens=2)
    status, headers, body = request(sim.port, "GET", "/metrics")
    text = body.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name + "{" in text, name
    assert 'finished_reason="length"' in text and 'engine="0"' in text
    assert 'model_name="motor-sim"' in text


def test_tokenize_detokenize(sim):
    status, d = post_json(sim.port, "/tokenize", {"model": "motor-sim", "prompt": "hi!"})
    assert status == 200 and d["tokens"] == [104, 105, 33] and d["count"] == 3
    assert d["max_model_len"] == 4096
    status, d = post_json(sim.port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert d["count"] == 21
    status, d = post_json(sim.port, "/detokenize", {"tokens": [104, 105]})
    assert status == 200 and d == {"prompt": "hi"}


def test_client_disconnect_aborts_the_request(sim):
    before = get_json(sim.port, "/admin/stats")["aborted"]
    body = json.dumps({"prompt": "long", "max_tokens": 3000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", sim.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(65536)
            assert chunk
            got += chunk
    finally:
        s.close()
    wait_until(lambda: get_json(sim.port, "/admin/stats")["aborted"] == before + 1, what="abort")
    st = get_json(sim.port, "/admin/stats")
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_usage"] == 0.0
    assert st["disconnects"] >= 1


def test_dead_engine_loop_fails_requests_and_health(model_dir):
    from .helpers import SimThread

    with SimThread(model_dir, engine={"time_scale": 0.05}) as s:
        def boom(now):
            raise RuntimeError("injected engine bug")

        def arm():
            s.server.engine._schedule = boom
        s.call(arm)
        status, d = post_json(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert status == 500 and d["error"]["code"] == 500
        status, _, _ = request(s.port, "GET", "/health")
        assert status == 503
        status, d = post_json(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert status == 503


def test_completion_null_max_tokens_is_vllms_16_too(sim):
    # vLLM 0.32 reads an explicit null like an absent max_tokens (measured on the CPU build)
    d = _completion(sim, prompt="default length", max_tokens=None)
    assert d["usage"]["completion_tokens"] == 16
