"""Fault injection through POST /admin/fault (crash is in test_cli.py: it ends the process)."""
from __future__ import annotations

import http.client
import json
import socket

import pytest

from .helpers import get_json, post_json, request, stream_events, wait_until


def _fault(sim, **spec):
    status, d = post_json(sim.port, "/admin/fault", spec)
    assert status == 200, d
    return d


def test_bad_fault_spec_is_400(sim_nofault):
    for spec in ({"mode": "explode"}, {"mode": "error", "status": 42}, {"mode": "slow", "factor": 0},
                 {"mode": "drop_after", "tokens": -1}, {"mode": "error", "count": "x"}):
        status, d = post_json(sim_nofault.port, "/admin/fault", spec)
        assert status == 400 and d["error"]["code"] == 400, spec
    assert get_json(sim_nofault.port, "/admin/fault")["mode"] == "none"


def test_error_fault_with_count(sim_nofault):
    sim = sim_nofault
    _fault(sim, mode="error", status=503, count=2)
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, d = post_json(sim.port, path, body)
        assert status == 503 and d["error"]["code"] == 503
    status, d = post_json(sim.port, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200
    f = get_json(sim.port, "/admin/fault")
    assert f["mode"] == "none" and f["applied"]["error"] == 2


def test_drop_after_closes_stream_without_done(sim_nofault):
    sim = sim_nofault
    before = get_json(sim.port, "/admin/stats")
    _fault(sim, mode="drop_after", tokens=3, count=1)
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "drop me", "max_tokens": 50, "stream": True})
    assert status == 200 and not done
    assert 1 <= len(events) <= 3
    st = get_json(sim.port, "/admin/stats")
    assert st["dropped"] == before["dropped"] + 1 and st["aborted"] == before["aborted"] + 1
    assert st["running"] == 0
    # count=1: the next stream is whole
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "fine", "max_tokens": 5, "stream": True})
    assert done and len(events) == 5


def test_drop_after_non_stream_gets_no_answer(sim_nofault):
    sim = sim_nofault
    _fault(sim, mode="drop_after", tokens=2, count=1)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        request(sim.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 50})


def test_recomputed_after(sim_nofault):
    sim = sim_nofault
    _fault(sim, mode="recomputed_after", tokens=2, count=3)
    status, events, done = stream_events(sim.port, "/v1/completions", {
        "prompt": "recompute", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}})
    assert done
    *chunks, usage = events
    assert "".join(c["choices"][0]["text"] for c in chunks).__len__() == 2
    last = chunks[-1]["choices"][0]
    assert last["text"] == "" and last["finish_reason"] == "stop" and last["stop_reason"] == "recomputed"
    assert usage["usage"]["completion_tokens"] == 2
    status, d = post_json(sim.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 50})
    c = d["choices"][0]
    assert len(c["message"]["content"]) == 2 and c["stop_reason"] == "recomputed"
    _fault(sim, mode="recomputed_after", tokens=0, count=1)
    status, d = post_json(sim.port, "/v1/completions", {"prompt": "x", "max_tokens": 50})
    c = d["choices"][0]
    assert c["text"] == "" and c["finish_reason"] == "stop" and c["stop_reason"] == "recomputed"


def test_slow_sets_the_step_factor(sim_nofault):
    sim = sim_nofault
    _fault(sim, mode="slow", factor=4.0)
    assert get_json(sim.port, "/admin/stats")["slow_factor"] == 4.0
    status, d = post_json(sim.port, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 200 and d["usage"]["completion_tokens"] == 3
    _fault(sim, mode="none")
    assert get_json(sim.port, "/admin/stats")["slow_factor"] == 1.0


def test_hang_blocks_generation_but_not_health(sim_nofault):
    sim = sim_nofault
    before = get_json(sim.port, "/admin/stats")["aborted"]
    _fault(sim, mode="hang")
    with pytest.raises((socket.timeout, TimeoutError)):
        request(sim.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3}, timeout=0.5)
    status, _, _ = request(sim.port, "GET", "/health", timeout=5)
    assert status == 200
    assert get_json(sim.port, "/admin/stats")["hanging"] is True
    _fault(sim, mode="none")
    # the timed-out client went away: its request was aborted
    wait_until(lambda: get_json(sim.port, "/admin/stats")["aborted"] == before + 1, what="abort")
    status, d = post_json(sim.port, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 200


def test_chat_role_chunk_waits_for_the_first_token(sim_nofault):
    """Like vLLM, the chat stream's role chunk comes with the engine's first output: an
    engine stuck before prefill has sent no SSE event (a gateway may still retry)."""
    sim = sim_nofault
    _fault(sim, mode="hang")
    body = json.dumps({"model": "motor-sim", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        s.settimeout(0.5)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
        assert b"data:" not in got
        _fault(sim, mode="none")
        s.settimeout(10)
        while b"data: [DONE]" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    events = [json.loads(line[6:]) for line in got.split(b"\r\n\r\n", 1)[1].split(b"\n")
              if line.startswith(b"data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:]) != ""


def test_hang_health_also_blocks_health(sim_nofault):
    sim = sim_nofault
    _fault(sim, mode="hang_health")
    with pytest.raises((socket.timeout, TimeoutError)):
        request(sim.port, "GET", "/health", timeout=0.5)
    _fault(sim, mode="none")
    status, _, _ = request(sim.port, "GET", "/health", timeout=5)
    assert status == 200
