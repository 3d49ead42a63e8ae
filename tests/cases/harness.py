"""The black-box harness of ../shared/cases/bug_cases.md section 0, in process.

* :class:`FB` - a scriptable OpenAI-compatible fake backend with a request log (arrival,
  headers, raw body and sha256, response start, ``closed_at`` when the gateway closed
  the connection, whether the scripted answer was written in full, tokens written).
  Its behaviour is a coroutine ``behave(fb, req, resp, entry)``; the default one answers
  as in section 0.3 (honours ``stream``, ``max_tokens``, ``stream_options`` and
  ``return_token_ids``).
* :func:`cluster` - FBs + an in-process coordinator (standalone mode) on 127.0.0.1.
* raw clients: :func:`tests.support.gateway.http`, :func:`stream` (SSE events as they
  arrive, with a callback per event) and :func:`open_request` (for disconnects).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from motor.config.schema import Role
from motor.http.server import HttpServer, Request, Response
from tests.support.gateway import Gateway, http, run_async

__all__ = ["FB", "Entry", "cluster", "http", "run_async", "stream", "open_request", "chat_chunk",
           "cmpl_chunk", "sse", "events", "CHAT_OBJ", "wait_for"]

Behave = Callable[["FB", Request, Response, "Entry"], Awaitable[None]]


@dataclass
class Entry:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    arrived: float
    started: float | None = None
    closed_at: float | None = None
    complete: bool = False
    tokens_written: int = 0

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def chat_chunk(text: str, finish: str | None = None, role: bool = False, model: str = "m",
               **extra: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
    c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    c.update(extra)
    return {"id": "chatcmpl-fb", "object": "chat.completion.chunk", "created": 1700000000,
            "model": model, "choices": [c]}


def cmpl_chunk(text: str, finish: str | None = None, model: str = "m", **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    c.update(extra)
    return {"id": "cmpl-fb", "object": "text_completion", "created": 1700000000, "model": model,
            "choices": [c]}


CHAT_OBJ = {"id": "chatcmpl-fb", "object": "chat.completion", "created": 1700000000, "model": "m"}


def events(body: bytes) -> list[bytes]:
    """The data payloads of an SSE body (comments dropped)."""
    out = []
    for ev in body.split(b"\n\n"):
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


async def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


class FB:
    """A fake backend (see the module docstring)."""

    def __init__(self, models: tuple[str, ...] = ("m",), behave: Behave | None = None,
                 tokens: int = 5, token_delay_s: float = 0.0) -> None:
        self.models = models
        #: the whole /v1/models list when set (e.g. LoRA adapters with "parent")
        self.model_entries: list[dict[str, Any]] | None = None
        self.behave: Behave = behave or default_behave
        self.tokens = tokens
        self.token_delay_s = token_delay_s
        self.log: list[Entry] = []
        self.health_status = 200
        self.health_hang = False
        self.models_refused = False
        self.port = 0
        self.open_requests = 0
        self.max_open = 0
        self.abort_bodies: list[bytes] = []
        self._server: HttpServer | None = None

    async def start(self, port: int = 0, tls: Any = None) -> FB:
        """Listen (``tls``: an HTTPS engine with that server context)."""
        self._server = HttpServer(self._handle)
        self.port = await self._server.listen("127.0.0.1", port or self.port, tls=tls)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.shutdown(0.2)
            self._server = None

    def gen(self, path: str | None = None) -> list[Entry]:
        return [e for e in self.log if path is None or e.path == path]

    async def _handle(self, req: Request, resp: Response) -> None:
        p = req.path
        if p == "/health":
            if self.health_hang:
                await asyncio.sleep(3600)
            resp.send(self.health_status, b"{}")
            return
        if p == "/v1/models":
            if self.models_refused:
                resp.abort()
                return
            entries = self.model_entries or [
                {"id": m, "object": "model", "created": 0, "owned_by": "fb"} for m in self.models]
            resp.send(200, orjson.dumps({"object": "list", "data": entries}))
            return
        if p == "/metrics":
            resp.send(200, b"", content_type=b"text/plain")
            return
        if p == "/abort_request":
            self.abort_bodies.append(req.body)
            resp.send(200, b"{}")
            return
        if p in ("/get_server_info", "/server_info"):
            resp.send(200, b'{"disaggregation_bootstrap_port": 8998, "dp_size": 1}')
            return
        e = Entry(req.method.decode(), p, {k.decode(): v.decode("latin-1") for k, v in req.headers},
                  req.body, time.monotonic())
        self.log.append(e)
        self.open_requests += 1
        self.max_open = max(self.max_open, self.open_requests)
        try:
            await self.behave(self, req, resp, e)
            if resp.finished and not resp.client_gone:
                e.complete = True
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open_requests -= 1
            if not e.complete and e.closed_at is None:
                e.closed_at = time.monotonic()


async def write_events(resp: Response, e: Entry, evs: list[bytes], delay_s: float = 0.0) -> None:
    """Write each event with its own write, counting tokens; stops when the gateway left."""
    for ev in evs:
        if resp.client_gone:
            raise ConnectionResetError("gateway closed the stream")
        resp.write(ev)
        e.tokens_written += 1
        await resp.drain()
        if delay_s:
            await asyncio.sleep(delay_s)


async def default_behave(fb: FB, req: Request, resp: Response, e: Entry) -> None:
    """Section 0.3: chat / completions, streaming or not; ``max_tokens`` tokens (``fb.tokens``
    when absent); ``stream_options.include_usage``; ``return_token_ids`` (token id = 1000 + i)."""
    try:
        body = orjson.loads(req.body)
    except orjson.JSONDecodeError:
        resp.send(400, b'{"error":{"message":"bad json","type":"BadRequestError","param":null,"code":400}}')
        return
    n = body.get("max_tokens") or body.get("max_completion_tokens") or fb.tokens
    chat = e.path == "/v1/chat/completions"
    ids = body.get("return_token_ids") is True
    e.started = time.monotonic()
    if not body.get("stream"):
        text = "".join(f"tok{i} " for i in range(n))
        if chat:
            out = dict(CHAT_OBJ, choices=[{"index": 0, "message": {"role": "assistant", "content": text},
                                           "finish_reason": "stop"}])
        else:
            out = {"id": "cmpl-fb", "object": "text_completion", "created": 1700000000, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
        out["usage"] = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        resp.send(200, orjson.dumps(out))
        return
    resp.start(200)
    evs = []
    for i in range(n):
        fin = "stop" if i == n - 1 else None
        extra: dict[str, Any] = {"token_ids": [1000 + i]} if ids else {}
        if chat:
            c = chat_chunk(f"tok{i} ", fin, role=(i == 0), **extra)
            if ids and i == 0:
                c["prompt_token_ids"] = [1, 2, 3, 4, 5]
        else:
            if ids and i == 0:
                extra["prompt_token_ids"] = [1, 2, 3, 4, 5]
            c = cmpl_chunk(f"tok{i} ", fin, **extra)
        evs.append(sse(c))
    await write_events(resp, e, evs, fb.token_delay_s)
    so = body.get("stream_options") or {}
    if so.get("include_usage"):
        resp.write(sse({"id": "chatcmpl-fb", "object": "chat.completion.chunk", "created": 1700000000,
                        "model": "m", "choices": [],
                        "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}))
    resp.end(b"data: [DONE]\n\n")


@asynccontextmanager
async def cluster(n: int = 1, *, fbs: list[FB] | None = None, probe: bool = False,
                  **cfg: Any) -> AsyncIterator[tuple[list[FB], Gateway]]:
    """``n`` fake backends (or the given ones) behind an in-process coordinator."""
    fbs = fbs or [FB() for _ in range(n)]
    for fb in fbs:
        if fb._server is None:
            await fb.start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs], probe=probe, **cfg).start()
    try:
        yield fbs, gw
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()


async def open_request(port: int, path: str, body: bytes,
                       headers: dict[str, str] | None = None
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    h = {"host": f"127.0.0.1:{port}", "content-length": str(len(body)),
         "content-type": "application/json"}
    h.update(headers or {})
    writer.write((f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
                  + "\r\n").encode() + body)
    await writer.drain()
    return reader, writer


async def stream(port: int, path: str, body: bytes, on_event: Callable[[bytes], None] | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 20.0
                 ) -> tuple[int, dict[str, str], list[bytes], int]:
    """POST and read a chunked SSE answer as it arrives; ``on_event(payload)`` per data event.

    Returns (status, headers, data payloads, number of socket reads)."""
    reader, writer = await open_request(port, path, body, headers)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs: dict[str, str] = {}
        for ln in lines[1:]:
            if ":" in ln:
                k, v = ln.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        out: list[bytes] = []
        reads = 0
        if hdrs.get("transfer-encoding") != "chunked":
            data = await asyncio.wait_for(reader.readexactly(int(hdrs.get("content-length", "0"))),
                                          timeout_s)
            return status, hdrs, [data], 1
        buf = b""
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout_s)
            size = int(size_line.strip(), 16)
            reads += 1
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            buf += await asyncio.wait_for(reader.readexactly(size), timeout_s)
            await reader.readexactly(2)
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        out.append(payload)
                        if on_event is not None:
                            on_event(payload)
        return status, hdrs, out, reads
    finally:
        writer.close()


def content(payloads: list[bytes]) -> list[str]:
    """Concatenable content pieces of chat or completion chunks (error/usage/[DONE] skipped)."""
    out = []
    for p in payloads:
        if p == b"[DONE]":
            continue
        o = orjson.loads(p)
        for c in o.get("choices") or []:
            t = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if t:
                out.append(t)
    return out


__all__ += ["content", "write_events", "default_behave", "field", "dataclass"]
