"""Client load for the pod-shaped test: the official ``openai`` client (async, ``max_retries=0``
so that every failure is seen), requests back to back through each coordinator.

``python -m tests.deploy.pod_load --out FILE --model M --key K NAME=URL ...`` runs ``--per``
clients per coordinator until SIGTERM, then lets the requests in flight finish; each request
is one JSON line in FILE: ``{"coordinator", "stream", "chat", "start", "end", "error"}`` with
``time.monotonic()`` times (CLOCK_MONOTONIC: comparable with the test process's clock) and
``error`` null on success. A process of its own, so the load neither shares the test's
interpreter (a client per thread there would) nor waits on its GIL.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from typing import Any

TIMEOUT_S = 20.0   #: one request, connect to last byte


async def one_request(client: Any, model: str, stream: bool, chat: bool) -> str:
    """One request through ``client`` (an ``openai.AsyncOpenAI``); the answer's text.

    Raises
    ------
    Exception
        whatever the client raises (HTTP status, connection, timeout), or AssertionError for
        an empty answer.
    """
    text = ""
    if chat:
        msgs = [{"role": "user", "content": "Say hello to the pods."}]
        if stream:
            async for ch in await client.chat.completions.create(
                    model=model, messages=msgs, max_tokens=8, stream=True):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
        else:
            r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=8)
            text = r.choices[0].message.content or ""
    elif stream:
        async for ch in await client.completions.create(model=model, prompt="The pods say",
                                                        max_tokens=8, stream=True):
            if ch.choices:
                text += ch.choices[0].text
    else:
        r = await client.completions.create(model=model, prompt="The pods say", max_tokens=8)
        text = r.choices[0].text
    if not text:
        raise AssertionError("empty answer")
    return text


def client(url: str, key: str) -> Any:
    import openai
    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=key, max_retries=0,
                              timeout=TIMEOUT_S)


async def _loop(c: Any, name: str, model: str, k: int, stop: asyncio.Event, out: Any) -> None:
    i = k
    while not stop.is_set():
        stream, chat = i % 2 == 0, i % 4 < 2
        t0 = time.monotonic()
        err = None
        try:
            await one_request(c, model, stream, chat)
        except Exception as e:  # noqa: BLE001 - every failure is an outcome
            err = f"{type(e).__name__}: {e}"[:300]
        out.write(json.dumps({"coordinator": name, "stream": stream, "chat": chat,
                              "start": t0, "end": time.monotonic(), "error": err}) + "\n")
        out.flush()
        i += 1


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    targets = [t.split("=", 1) for t in args.targets]
    with open(args.out, "a") as out:
        clients = [(name, client(url, args.key)) for name, url in targets]
        await asyncio.gather(*(_loop(c, name, args.model, k, stop, out)
                               for name, c in clients for k in range(args.per)))
        for _name, c in clients:
            await c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--per", type=int, default=2, help="clients per coordinator")
    p.add_argument("targets", nargs="+", help="NAME=URL of each coordinator")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
