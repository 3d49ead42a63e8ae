"""A very fast fake OpenAI backend for proxy benchmarks (motor.http server, pre-encoded answers).

``python bench/fast_backend.py [--pace-ms MS] PORT [PORT ...]`` serves ``/health``,
``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``: a fixed JSON answer, or,
with ``"stream": true``, 16 SSE events and ``[DONE]``, each event its own write. With
``--pace-ms`` the events are ``MS`` milliseconds apart (each then reaches a proxy in a read
of its own, as an engine's tokens do).
"""
from __future__ import annotations

import asyncio
import sys

import orjson

from motor.http.server import HttpServer, Request, Response, install_uvloop

TOKENS = 16
#: seconds between two events of a stream (``--pace-ms``); 0: written at once
PACE_S = 0.0
_JSON = orjson.dumps({"id": "cmpl-b", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "message": {"role": "assistant",
                                                           "content": "tok " * TOKENS},
                                   "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS,
                                "total_tokens": 8 + TOKENS}})
_EVENTS = [b"data: " + orjson.dumps({"id": "cmpl-b", "object": "chat.completion.chunk",
                                     "created": 0, "model": "m", "choices": [
                                         {"index": 0, "delta": {"content": "tok "},
                                          "finish_reason": "length" if i == TOKENS - 1 else None}]})
           + b"\n\n" for i in range(TOKENS)]
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def handle(req: Request, resp: Response) -> None:
    if req.path == "/health":
        resp.send(200, b"")
    elif req.path == "/v1/models":
        resp.send(200, _MODELS)
    elif b'"stream":true' in req.body or b'"stream": true' in req.body:
        resp.start(200)
        for ev in _EVENTS:
            resp.write(ev)
            if PACE_S:
                await resp.drain()
                await asyncio.sleep(PACE_S)
        resp.end(b"data: [DONE]\n\n")
    else:
        resp.send(200, _JSON)


async def main(ports: list[int]) -> None:
    srv = HttpServer(handle)
    for p in ports:
        await srv.listen("127.0.0.1", p)
    await asyncio.Event().wait()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--pace-ms"]:
        PACE_S = float(args[1]) / 1000.0
        args = args[2:]
    install_uvloop()
    asyncio.run(main([int(p) for p in args]))
