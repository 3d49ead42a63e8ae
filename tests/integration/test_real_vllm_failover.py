"""Mid-stream failover against a real vLLM (CPU build, tiny random Llama): the design claims
of docs/faults.md checked on the engine itself.

* a chat stream with ``return_token_ids`` gives the templated prompt's ids (first chunk) and
  the ids of every delta;
* a ``/v1/completions`` request with prompt = those prompt ids + the first k generated ids
  (greedy) continues with exactly the ids and text the uninterrupted chat produced;
* :class:`StreamRecovery` cut after k tokens and continued that way gives the client the
  uninterrupted chat text, with no token ids or ``prompt_text`` shown; also for a chat
  without ``max_tokens`` (continued with the rest of the context);
* ``/tokenize`` and ``/v1/responses`` (whole, streamed, ``previous_response_id``) through a
  standalone coordinator with the official openai client.

Slow lane (``-m real_engine``); skipped without the vLLM CPU venv (see test_real_vllm.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from motor.coordinator.recovery import StreamRecovery
from tests.integration.test_real_vllm import ENGINE_ENV, vllm_python, write_tiny_llama
from tests.support.procs import free_ports

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]


def post(port: int, path: str, body: dict) -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def sse(raw: bytes) -> list[dict]:
    return [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]


def test_chat_continues_exactly_as_a_completion_of_its_token_ids(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail("MOTOR_REQUIRE_REAL_ENGINE=1 but no vLLM CPU venv (MOTOR_VLLM_VENV)")
        pytest.skip("no vLLM CPU venv")
    model = write_tiny_llama(tmp_path / "tiny")
    port = free_ports(1)[0]
    log = open(tmp_path / "vllm.log", "wb")
    p = subprocess.Popen([py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                          "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                          "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
                          "--block-size", "32",
                          "--kv-cache-memory-bytes", str(8 * 1024 * 1024),
                          "--disable-uvicorn-access-log"],
                         # stored responses (previous_response_id): vLLM keeps them only
                         # with VLLM_ENABLE_RESPONSES_API_STORE=1
                         env=dict(os.environ, **ENGINE_ENV, VLLM_ENABLE_RESPONSES_API_STORE="1"),
                         stdout=log, stderr=log,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:  # noqa: BLE001
                assert p.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "vllm.log").read_text()[-3000:]
                time.sleep(1)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}],
                "stream": True, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        raw = post(port, "/v1/chat/completions", dict(chat, return_token_ids=True))
        ev = sse(raw)
        prompt_ids = next(e["prompt_token_ids"] for e in ev if e.get("prompt_token_ids"))
        # the engine's own bytes through the byte scanner, an event a block: its chunks
        # repeat one shape but for text and ids, so nearly all are read from it
        # (EventScanner shapes), and what the client gets and the ids recorded are the
        # JSON path's
        fast, slow = StreamRecovery(True, chat), StreamRecovery(True, chat, scan=False)
        for b in (x + b"\n\n" for x in raw.split(b"\n\n") if x.strip()):
            assert sse(fast.feed(b)) == sse(slow.feed(b)), b
        assert fast.gen == slow.gen and len(fast.gen) == 30
        assert fast.scanner is not None and fast.scanner.fallbacks == 0
        # the role event, the first content one (kept as the shape) and the last (its
        # finish_reason) are read in full; vLLM puts several tokens in one chunk when the
        # reader lags (30 tokens came in 27 chunks in one run), so count chunks, not tokens
        assert fast.scanner.shaped >= len(ev) - 4, (fast.scanner.shaped, len(ev), raw[:600])
        ids: list[int] = []
        text = ""
        for e in ev:
            for c in e["choices"]:
                ids += c.get("token_ids") or []
                text += c["delta"].get("content") or ""
        assert len(ids) == 30
        k = 11
        ev2 = sse(post(port, "/v1/completions", {
            "model": "tiny", "prompt": prompt_ids + ids[:k], "stream": True, "max_tokens": 30 - k,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}))
        assert [t for e in ev2 for c in e["choices"] for t in (c.get("token_ids") or [])] == ids[k:]

        r = StreamRecovery(True, chat)
        out = b""
        for e in ev:
            out += r.feed(b"data: " + json.dumps(e).encode() + b"\n\n")
            if len(r.gen) >= k:
                break
        path, body = r.continuation(b"/v1/chat/completions")
        assert path == b"/v1/completions"
        out += r.feed(post(port, path.decode(), json.loads(body)))
        full = ""
        for e in sse(out):
            assert "prompt_token_ids" not in e and "prompt_text" not in e
            for c in e["choices"]:
                assert "token_ids" not in c and e["object"] == "chat.completion.chunk"
                full += c["delta"].get("content") or ""
        assert full == text
        assert out.endswith(b"data: [DONE]\n\n")

        # a chat without max_tokens (the rest of the context): its continuation asks for the
        # rest of the context (max_model_len from /v1/models); vLLM's /v1/completions would
        # stop at 16 without max_tokens, and with max_tokens null too (case N05)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                                   timeout=30).read())
        max_len = models["data"][0]["max_model_len"]
        assert max_len == 2048
        nolimit = {k: v for k, v in chat.items() if k != "max_tokens"}
        ev = sse(post(port, "/v1/chat/completions", dict(nolimit, return_token_ids=True)))
        text = "".join(c["delta"].get("content") or "" for e in ev for c in e["choices"])
        n_gen = sum(len(c.get("token_ids") or []) for e in ev for c in e["choices"])
        assert n_gen > 100                          # far past the completions default of 16
        r = StreamRecovery(True, nolimit)
        out = b""
        for e in ev:
            out += r.feed(b"data: " + json.dumps(e).encode() + b"\n\n")
            if len(r.gen) >= k:
                break
        path, body = r.continuation(b"/v1/chat/completions", max_len)
        assert json.loads(body)["max_tokens"] == max_len - len(prompt_ids) - k
        out += r.feed(post(port, path.decode(), json.loads(body)))
        full = "".join(c["delta"].get("content") or "" for e in sse(out) for c in e["choices"])
        assert full == text and len(r.gen) == n_gen
        _engine_routes_through_motor(port, tmp_path)
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


def _engine_routes_through_motor(engine_port: int, tmp_path: Path) -> None:
    """/tokenize and /v1/responses (whole, streamed, previous_response_id) of the real engine
    through a standalone coordinator, with the official openai client (issue 18)."""
    import sys

    import openai
    gw = free_ports(1)[0]
    log = open(tmp_path / "coordinator.log", "wb")
    c = subprocess.Popen([sys.executable, "-m", "motor", "coordinator", "--port", str(gw),
                          "--backend", f"http://127.0.0.1:{engine_port}"],
                         stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{gw}/readiness", timeout=1)
                break
            except Exception:  # noqa: BLE001
                assert c.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "coordinator.log").read_text()[-3000:]
                time.sleep(0.2)
        tok = json.loads(post(gw, "/tokenize", {"model": "tiny", "prompt": "hello"}))
        direct = json.loads(post(engine_port, "/tokenize", {"model": "tiny", "prompt": "hello"}))
        assert tok == direct and tok["count"] > 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="none",
                               max_retries=0)
        first = client.responses.create(model="tiny", input="hi", max_output_tokens=5)
        assert first.id.startswith("resp_") and first.output_text
        kinds = {ev.type for ev in client.responses.create(model="tiny", input="hi",
                                                            max_output_tokens=5, stream=True)}
        assert {"response.created", "response.completed"} <= kinds
        follow = client.responses.create(model="tiny", input="and then?", max_output_tokens=5,
                                         previous_response_id=first.id)
        assert follow.id != first.id and follow.output_text
        client.close()
    finally:
        os.killpg(c.pid, signal.SIGTERM)
        try:
            c.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
        log.close()
