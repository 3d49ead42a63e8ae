"""A scriptable fake OpenAI backend for coordinator tests (runs in the test's event loop).

Each request is logged (method, path, headers, body, time the answer started, time the
connection was seen closed, whether the scripted answer was written in full). The
behaviour for the next requests is set with :meth:`FakeBackend.script`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from motor.http.server import HttpServer, Request, Response


@dataclass
class Logged:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    arrived: float
    started: float | None = None
    closed_at: float | None = None
    complete: bool = False

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Script:
    """What the backend does with a request.

    mode: ``ok`` | ``status`` (answer ``status`` with ``body``) | ``hang`` | ``close``
    (close before answering) | ``drop_after`` (stream ``drop_at`` chunks, then close).
    """
    mode: str = "ok"
    status: int = 200
    body: bytes | None = None
    tokens: int = 5
    delay_s: float = 0.0
    text: str = "tok"
    drop_at: int = 2
    token_delay_s: float = 0.0


def chunk(text: str, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"content": text}
    if role:
        delta = {"role": "assistant", "content": text}
    obj = {"id": "chatcmpl-fb", "object": "chat.completion.chunk", "created": 1700000000,
           "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass
class FakeBackend:
    model: str = "m"
    log: list[Logged] = field(default_factory=list)
    default: Script = field(default_factory=Script)
    queue: list[Script] = field(default_factory=list)
    health_status: int = 200
    port: int = 0
    _server: HttpServer | None = None

    def script(self, *scripts: Script) -> None:
        self.queue.extend(scripts)

    def requests(self, path: str | None = None) -> list[Logged]:
        return [r for r in self.log if path is None or r.path == path]

    async def start(self) -> FakeBackend:
        self._server = HttpServer(self._handle)
        self.port = await self._server.listen("127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.shutdown(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, req: Request, resp: Response) -> None:
        if req.path == "/health":
            resp.send(self.health_status, b"{}")
            return
        if req.path == "/v1/models":
            resp.send(200, orjson.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "fb"}]}))
            return
        if req.path == "/metrics":
            resp.send(200, b"", content_type=b"text/plain")
            return
        entry = Logged(req.method.decode(), req.path,
                       {k.decode(): v.decode() for k, v in req.headers}, req.body, time.monotonic())
        self.log.append(entry)
        s = self.queue.pop(0) if self.queue else self.default
        try:
            await self._answer(s, req, resp, entry)
        finally:
            if not entry.complete:
                entry.closed_at = time.monotonic()

    async def _answer(self, s: Script, req: Request, resp: Response, entry: Logged) -> None:
        if s.delay_s:
            await asyncio.sleep(s.delay_s)
        if s.mode == "hang":
            await asyncio.sleep(3600)
        if s.mode == "close":
            resp.abort()
            return
        if s.mode == "status":
            entry.started = time.monotonic()
            resp.send(s.status, s.body if s.body is not None else b"{}")
            entry.complete = True
            return
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError:
            resp.send(400, b'{"error":{"message":"bad json","type":"BadRequestError","code":400}}')
            return
        stream = bool(body.get("stream"))
        n = s.tokens
        entry.started = time.monotonic()
        if not stream:
            text = "".join(f"{s.text}{i} " for i in range(n))
            out = {"id": "chatcmpl-fb", "object": "chat.completion", "created": 1700000000,
                   "model": self.model, "choices": [{"index": 0, "message": {
                       "role": "assistant", "content": text}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
            resp.send(200, orjson.dumps(out))
            entry.complete = True
            return
        resp.start(200)
        for i in range(n):
            resp.write(chunk(f"{s.text}{i} ", "stop" if i == n - 1 else None, role=(i == 0)))
            await resp.drain()
            if s.mode == "drop_after" and i + 1 >= s.drop_at:
                resp.abort()
                return
            if s.token_delay_s:
                await asyncio.sleep(s.token_delay_s)
        so = body.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage"):   # other types: no usage chunk
            resp.write(b"data: " + orjson.dumps({"id": "chatcmpl-fb", "object": "chat.completion.chunk",
                                                 "created": 1700000000, "model": self.model,
                                                 "choices": [], "usage": {
                                                     "prompt_tokens": 5, "completion_tokens": n,
                                                     "total_tokens": 5 + n}}) + b"\n\n")
        resp.end(b"data: [DONE]\n\n")
        entry.complete = True
