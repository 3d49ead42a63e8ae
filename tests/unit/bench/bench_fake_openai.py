"""A tiny fake OpenAI-compatible server for the bench tests (aiohttp.web, 127.0.0.1).

Runs in a background thread with its own event loop so that both the library
(``asyncio.run(run_bench(...))``) and the CLI (which starts its own loop) can
talk to it.  Its behaviour is set by ``mode``:

* ``ok``: answers with ``max_tokens`` chunks, ``usage`` (prompt_tokens = prompt
  bytes, cached_tokens = ``cached`` when set), then ``[DONE]``;
* ``nousage``: the same without any ``usage``;
* ``fail_every``: ``fail_every=k`` -> every k-th request (1-based) gets a 500;
* ``sse_error``: a content chunk, then ``data: {"error": ...}``;
* ``event_error``: a content chunk, then ``event: error`` + data;
* ``no_done``: content chunks and no ``[DONE]``;
* ``malformed``: a content chunk, then ``data: {not json``;
* ``slow``: waits ``slow_s`` before answering (for timeouts).

Every answer's text is ``"re:<first 6 chars of the last user text>;"``
followed by filler tokens, so a test can see the previous answer in the next
turn's history.  Every request body and header set is recorded in ``requests``.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

MODEL = "fake-model-x"


def _last_user(body: dict) -> str:
    msgs = body.get("messages")
    if msgs:
        return msgs[-1]["content"]
    prompt = body.get("prompt", "")
    marker = "User: "
    i = prompt.rfind(marker)
    return prompt[i + len(marker):] if i >= 0 else prompt[-6:]


def _prompt_bytes(body: dict) -> int:
    if "messages" in body:
        return sum(len(m["content"].encode()) for m in body["messages"])
    return len(body.get("prompt", "").encode())


def answer_tokens(body: dict) -> list[str]:
    """The chunks the fake server sends for ``body`` (one token each)."""
    n = int(body.get("max_tokens") or 4)
    first = "re:" + _last_user(body)[:6] + ";"
    return [first] + [f" t{i}" for i in range(1, n)]


class FakeOpenAI:
    def __init__(self, mode: str = "ok", *, fail_every: int = 0, cached: int | None = None,
                 slow_s: float = 5.0, split_writes: bool = False):
        self.mode = mode
        self.fail_every = fail_every
        self.cached = cached
        self.slow_s = slow_s
        self.split_writes = split_writes
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle ----------------------------------------------------------
    def start(self) -> FakeOpenAI:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self._start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    # ---- handlers -------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model"}, {"id": "other", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self._count += 1
        chat = request.path.endswith("chat/completions")
        if self.fail_every and self._count % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error",
                                                "code": 500}}, status=500)
        if self.mode == "slow":
            await asyncio.sleep(self.slow_s)
        toks = answer_tokens(body)
        pt = _prompt_bytes(body)
        usage: dict[str, Any] = {"prompt_tokens": pt, "completion_tokens": len(toks),
                                 "total_tokens": pt + len(toks)}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        if not body.get("stream"):
            text = "".join(toks)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            out = {"id": "x", "object": "chat.completion" if chat else "text_completion",
                   "model": body.get("model"), "choices": [choice]}
            if self.mode != "nousage":
                out["usage"] = usage
            return web.json_response(out)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(raw: bytes) -> None:
            if self.split_writes and len(raw) > 4:
                half = len(raw) // 2
                await resp.write(raw[:half])
                await asyncio.sleep(0.001)
                await resp.write(raw[half:])
            else:
                await resp.write(raw)

        async def event(obj: Any) -> None:
            await send(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(tok: str, i: int) -> dict:
            if chat:
                delta = {"content": tok}
                return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": tok}]}

        if chat:  # a role-only first chunk carries no content (must not count for TTFT)
            await event({"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i, tok in enumerate(toks):
            await event(chunk(tok, i))
            await asyncio.sleep(0.001)
            if i == 0 and self.mode == "sse_error":
                await event({"error": {"message": "engine died", "code": 500}})
                return resp
            if i == 0 and self.mode == "event_error":
                await send(b'event: error\ndata: {"error": {"message": "boom"}}\n\n')
                return resp
            if i == 0 and self.mode == "malformed":
                await send(b"data: {not json\n\n")
                return resp
        if self.mode != "nousage" and (body.get("stream_options") or {}).get("include_usage"):
            await event({"object": "chat.completion.chunk", "choices": [], "usage": usage})
        if self.mode != "no_done":
            await send(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
