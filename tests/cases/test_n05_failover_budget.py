"""N05: a stream continued on another engine keeps the request's token budget. A chat
without a limit continues with the rest of the context (the engines' ``max_model_len`` from
``/v1/models`` minus prompt and generated tokens), not with ``/v1/completions``' default of
16; a limit continues with what is left; a completion without a limit keeps vLLM's 16.
Usage counts every generated token."""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.cases.harness import (FB, chat_chunk, cluster, cmpl_chunk, content, run_async, sse,
                                 stream, wait_for, write_events)

PROMPT_IDS = [1, 2, 3, 4, 5]
EOS_AT = 200                 # the scripted answer ends (EOS, "stop") after 200 tokens


async def vllm_like(fb: FB, req, resp, e) -> None:
    """vLLM's token ids and defaults; a first leg breaks after ``fb.break_after`` tokens."""
    body = orjson.loads(req.body)
    chat = e.path == "/v1/chat/completions"
    prompt = body.get("prompt")
    continuation = isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    done = len(prompt) - len(PROMPT_IDS) if continuation else 0
    if chat:
        limit: Any = body.get("max_completion_tokens") or body.get("max_tokens")
        left = EOS_AT if limit is None else limit
    elif "max_tokens" not in body:
        left = 16                                    # vLLM CompletionRequest default
    else:
        limit = body["max_tokens"]
        left = EOS_AT - done if limit is None else limit     # null: the rest of the context
    n = min(left, EOS_AT - done)
    if not continuation:
        n = min(n, fb.break_after)
    resp.start(200)
    evs = []
    for i in range(n):
        k = done + i
        last = k == EOS_AT - 1
        fin = "stop" if last else ("length" if i == n - 1 and continuation else None)
        extra: dict[str, Any] = {"token_ids": [2000 + k]}
        if chat and not continuation:
            c = chat_chunk(f"t{k} ", fin, role=(i == 0), **extra)
            if i == 0:
                c["prompt_token_ids"] = PROMPT_IDS
        else:
            if i == 0 and not continuation:
                extra["prompt_token_ids"] = PROMPT_IDS
            c = cmpl_chunk(f"t{k} ", fin, **extra)
        evs.append(sse(c))
    await write_events(resp, e, evs)
    if not continuation:
        resp.abort()                                 # the first engine dies mid-stream
        return
    if (body.get("stream_options") or {}).get("include_usage"):
        resp.write(sse({"id": "cmpl-fb", "object": "text_completion", "created": 1700000000,
                        "model": "m", "choices": [],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                  "total_tokens": len(prompt) + n}}))
    resp.end(b"data: [DONE]\n\n")


MAX_MODEL_LEN = 4096


def _fbs(break_after: int) -> list[FB]:
    fbs = [FB(behave=vllm_like) for _ in range(2)]
    for fb in fbs:
        fb.break_after = break_after  # type: ignore[attr-defined]
        # vLLM's /v1/models: the context length the gateway continues an unbounded chat with
        fb.model_entries = [{"id": "m", "object": "model", "max_model_len": MAX_MODEL_LEN}]
    return fbs


def _learned(gw) -> bool:
    return all(e.max_model_len == MAX_MODEL_LEN for e in gw.table.endpoints.values())


def _finish(payloads: list[bytes]) -> str | None:
    for p in reversed(payloads):
        if p != b"[DONE]":
            for c in orjson.loads(p).get("choices") or []:
                if c.get("finish_reason"):
                    return c["finish_reason"]
    return None


def _usage(payloads: list[bytes]) -> dict[str, Any]:
    for p in payloads:
        if p != b"[DONE]":
            o = orjson.loads(p)
            if o.get("usage"):
                return o["usage"]
    return {}


def _continuation(fbs: list[FB]) -> dict[str, Any]:
    legs = [e for fb in fbs for e in fb.log if e.path == "/v1/completions"
            and isinstance(e.json.get("prompt"), list) and isinstance(e.json["prompt"][0], int)]
    assert len(legs) == 1
    return legs[0].json


@pytest.mark.parametrize("limit,expect,sent",
                         [(None, 200, MAX_MODEL_LEN - len(PROMPT_IDS) - 10), (120, 120, 110)],
                         ids=["chat_no_limit", "chat_max_tokens_120"])
@run_async
async def test_chat_continuation_keeps_the_budget(limit, expect, sent):
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "long story"}],
                            "stream": True, "stream_options": {"include_usage": True}}
    if limit is not None:
        body["max_tokens"] = limit
    async with cluster(fbs=_fbs(10), probe=True, health_check_interval_s=0.05) as (fbs, gw):
        assert await wait_for(lambda: _learned(gw))
        st, _, payloads, _ = await stream(gw.port, "/v1/chat/completions", orjson.dumps(body))
        assert st == 200 and payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1
        assert len(content(payloads)) == expect
        assert _finish(payloads) == ("stop" if limit is None else "length")
        assert _usage(payloads)["completion_tokens"] == expect
        cont = _continuation(fbs)
        assert "max_tokens" in cont and cont["max_tokens"] == sent


@run_async
async def test_completion_without_limit_keeps_vllms_16():
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    async with cluster(fbs=_fbs(5), probe=True, health_check_interval_s=0.05) as (fbs, gw):
        assert await wait_for(lambda: _learned(gw))
        st, _, payloads, _ = await stream(gw.port, "/v1/completions", orjson.dumps(body))
        assert st == 200 and payloads[-1] == b"[DONE]"
        assert len(content(payloads)) == 16
        assert _usage(payloads)["completion_tokens"] == 16
        assert _continuation(fbs)["max_tokens"] == 11
