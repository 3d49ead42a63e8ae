"""The load loop of ``motor bench``: send the dataset, time every answer.

One :class:`aiohttp.ClientSession` (keep-alive connector capped at the
concurrency) for the whole run.  A single dispatcher starts requests: in
closed loop it starts one whenever fewer than ``concurrency`` are in flight;
with ``request_rate`` it starts them at Poisson arrival times (exponential
gaps, seeded), still under the concurrency cap if one is set.  Each started
request takes a *ready* conversation: one-turn conversations are always
ready; a multi-turn conversation is ready again once its previous turn has
been answered (its next turn then carries that answer in its history).  With
``conversation_sampling="round_robin"`` it is the one that has waited longest;
with ``"random"`` any ready one, drawn from a generator seeded with ``seed``.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import orjson

from motor.bench.config import DEFAULT_NUM_REQUESTS, BenchConfig, BenchError
from motor.bench.datasets import Conversation, build_dataset, chat_messages, completion_prompt
from motor.bench.results import BenchResult, RequestResult

_ERROR_BODY_CHARS = 300


@dataclass
class _ConvState:
    conv: Conversation
    next_turn: int = 0
    history: list[tuple[str, str]] = field(default_factory=list)


class _ReadyPool:
    """Conversations whose next turn can be sent; ``get`` waits for one."""

    def __init__(self, sampling: str, seed: int) -> None:
        self._items: list[_ConvState] = []
        self._head = 0
        self._random = sampling == "random"
        self._rng = np.random.default_rng([seed, 2])
        self._nonempty = asyncio.Event()

    def put(self, state: _ConvState) -> None:
        self._items.append(state)
        self._nonempty.set()

    async def get(self) -> _ConvState:
        while self._head >= len(self._items):
            self._nonempty.clear()
            await self._nonempty.wait()
        if self._random:
            i = self._head + int(self._rng.integers(len(self._items) - self._head))
            items = self._items
            items[i], items[self._head] = items[self._head], items[i]
        state = self._items[self._head]
        self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._items):
            del self._items[:self._head]
            self._head = 0
        return state


def _error_text(body: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the body's start."""
    try:
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_ERROR_BODY_CHARS]
        if isinstance(err, str):
            return err[:_ERROR_BODY_CHARS]
    except (orjson.JSONDecodeError, TypeError):
        pass
    return body[:_ERROR_BODY_CHARS].decode("utf-8", "replace")


def _content(obj: dict, chat: bool) -> str:
    """The generated text carried by one chunk or answer (all choices)."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ""
    parts = []
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        if chat:
            d = ch.get("delta") or ch.get("message") or {}
            if isinstance(d, dict):
                for key in ("content", "reasoning_content", "reasoning"):
                    v = d.get(key)
                    if isinstance(v, str) and v:
                        parts.append(v)
        else:
            v = ch.get("text")
            if isinstance(v, str) and v:
                parts.append(v)
    return "".join(parts)


class _Fail(Exception):
    def __init__(self, reason: str, message: str, status: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status


def _apply_usage(res: RequestResult, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(pt, int):
        res.input_tokens = pt
    if isinstance(ct, int):
        res.output_tokens = ct
    if isinstance(pt, int) or isinstance(ct, int):
        res.usage_reported = True
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        res.cached_tokens = details["cached_tokens"]


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, chat: bool,
                       t0: float) -> str:
    """Consume an SSE answer; fill ttft/itl/usage of ``res``; return the text."""
    texts: list[str] = []
    usage: Any = None
    done = False
    event: bytes | None = None
    last = 0.0
    chunks = 0
    pending = b""

    def handle(line: bytes, now: float) -> None:
        nonlocal usage, done, event, last, chunks
        line = line.rstrip(b"\r")
        if not line:
            event = None
            return
        if line.startswith(b":"):
            return
        if line.startswith(b"event:"):
            event = line[6:].strip()
            return
        if not line.startswith(b"data:") or done:
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            return
        if event == b"error":
            raise _Fail("stream_error", _error_text(payload))
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise _Fail("malformed", "bad JSON in SSE chunk: "
                        + payload[:100].decode("utf-8", "replace")) from None
        if not isinstance(obj, dict):
            raise _Fail("malformed", "SSE chunk is not a JSON object")
        if obj.get("error"):
            raise _Fail("stream_error", _error_text(payload))
        if obj.get("usage"):
            usage = obj["usage"]
        text = _content(obj, chat)
        if text:
            if res.ttft is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
            chunks += 1
            texts.append(text)

    async for data in resp.content.iter_any():
        now = time.perf_counter()
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            handle(line, now)
    if pending:
        handle(pending, time.perf_counter())
    if not done:
        raise _Fail("no_done", "stream ended without 'data: [DONE]'")
    res.output_tokens = chunks
    _apply_usage(res, usage)
    return "".join(texts)


async def _read_json(resp: aiohttp.ClientResponse, res: RequestResult, chat: bool) -> str:
    body = await resp.read()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Fail("malformed", "body is not JSON: "
                    + body[:100].decode("utf-8", "replace")) from None
    if not isinstance(obj, dict):
        raise _Fail("malformed", "body is not a JSON object")
    if obj.get("error"):
        raise _Fail("error_body", _error_text(body))
    if not isinstance(obj.get("choices"), list) or not obj["choices"]:
        raise _Fail("malformed", "answer has no choices")
    text = _content(obj, chat)
    res.output_tokens = len(text.encode())
    _apply_usage(res, obj.get("usage"))
    return text


async def send_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       *, chat: bool, stream: bool, est_input_tokens: int | None = None,
                       conversation: int = 0, turn: int = 0) -> tuple[RequestResult, str]:
    """Send one request; return its measurements and the generated text.

    Never raises for a failed request (the result says why); only
    cancellation propagates.
    """
    res = RequestResult(conversation=conversation, turn=turn, ok=False,
                        input_tokens=est_input_tokens)
    text = ""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=orjson.dumps(body)) as resp:
            res.status = resp.status
            if resp.status != 200:
                raise _Fail(f"http_{resp.status}",
                            f"HTTP {resp.status}: {_error_text(await resp.read())}", resp.status)
            if stream:
                text = await _read_stream(resp, res, chat, t0)
            else:
                text = await _read_json(resp, res, chat)
        res.ok = True
    except _Fail as f:
        res.reason, res.error = f.reason, f.message
    except TimeoutError:
        res.reason, res.error = "timeout", "no complete answer within the request timeout"
    except (aiohttp.ClientError, OSError) as e:
        res.reason, res.error = "transport", f"{type(e).__name__}: {e}"
    res.e2el = time.perf_counter() - t0
    if not res.ok:
        res.ttft = None
        res.itl = []
    return res, text


async def fetch_model(session: aiohttp.ClientSession, base_url: str, timeout: float = 30.0) -> str:
    """The first model id of ``GET {base_url}/v1/models`` (``base_url`` with or without its
    ``/v1``: :attr:`BenchConfig.base_url`)."""
    url = BenchConfig(url=base_url).models_url
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise BenchError(f"GET {url}: HTTP {resp.status}: {_error_text(body)}")
    except TimeoutError:
        raise BenchError(f"GET {url}: no answer within {timeout:g} s") from None
    except (aiohttp.ClientError, OSError) as e:
        raise BenchError(f"GET {url}: {type(e).__name__}: {e}") from None
    try:
        data = orjson.loads(body)["data"]
        return str(data[0]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {url}: no model in the answer; pass --model") from None


def build_body(config: BenchConfig, model: str, state: _ConvState) -> tuple[dict[str, Any], int]:
    """The request body of the conversation's next turn and its prompt size in bytes."""
    conv, i = state.conv, state.next_turn
    user = conv.turns[i]
    body: dict[str, Any] = {"model": model, "max_tokens": conv.max_tokens[i],
                            "stream": config.stream}
    if config.chat:
        msgs = chat_messages(conv.system, state.history, user)
        body["messages"] = msgs
        est = sum(len(m["content"].encode()) for m in msgs)
    else:
        prompt = completion_prompt(conv.system, state.history, user, dialog=len(conv.turns) > 1)
        body["prompt"] = prompt
        est = len(prompt.encode())
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body, est


def dataset_for(config: BenchConfig) -> tuple[list[Conversation], int]:
    """The conversations of ``config`` and the number of requests to send."""
    n = config.num_requests
    if config.dataset != "multi-turn" and n is None:
        n = DEFAULT_NUM_REQUESTS
    convs = build_dataset(
        config.dataset, num_requests=n or 0, input_len=config.input_len,
        output_len=config.output_len, range_ratio=config.range_ratio,
        prefix_len=config.prefix_len, num_groups=config.num_groups,
        num_conversations=config.num_conversations, turns=config.turns, seed=config.seed)
    available = sum(len(c.turns) for c in convs)
    return convs, available if n is None else min(n, available)


async def run_bench(config: BenchConfig) -> BenchResult:
    """Run one benchmark against ``config.url`` and return its result.

    Raises :class:`BenchError` when the run cannot start (bad config, model
    list unreachable).  Failed requests do not raise: they are counted in
    the result.
    """
    config.validate()
    convs, total = dataset_for(config)
    cap = config.effective_concurrency()
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    connector = aiohttp.TCPConnector(limit=cap or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=timeout) as session:
        model = config.model or await fetch_model(session, config.url,
                                                  timeout=min(config.timeout, 30.0))
        return await _run(config, session, model, convs, total, cap)


async def _run(config: BenchConfig, session: aiohttp.ClientSession, model: str,
               convs: list[Conversation], total: int, cap: int | None) -> BenchResult:
    from tqdm import tqdm

    url = config.target_url
    ready = _ReadyPool(config.conversation_sampling, config.seed)
    for c in convs:
        ready.put(_ConvState(c))
    sem = asyncio.Semaphore(cap) if cap else None
    arrivals = np.random.default_rng([config.seed, 1])
    results: list[RequestResult] = []
    tasks: set[asyncio.Task] = set()
    bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not config.progress,
               dynamic_ncols=True, leave=False)
    t0 = time.perf_counter()
    failed = 0

    async def one(state: _ConvState) -> None:
        nonlocal failed
        try:
            body, est = build_body(config, model, state)
            start = time.perf_counter() - t0
            res, text = await send_request(
                session, url, body, chat=config.chat, stream=config.stream,
                est_input_tokens=est, conversation=state.conv.id, turn=state.next_turn)
            res.start = start
            results.append(res)
            if res.ok:
                state.history.append((state.conv.turns[state.next_turn], text))
            else:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
        finally:
            state.next_turn += 1
            if sem is not None:
                sem.release()
            if state.next_turn < len(state.conv.turns):
                ready.put(state)

    async def dispatch() -> None:
        issued = 0
        next_at = 0.0
        while issued < total:
            if config.request_rate:
                next_at += float(arrivals.exponential(1.0 / config.request_rate))
                delay = t0 + next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            state = await ready.get()
            issued += 1
            task = asyncio.create_task(one(state))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    try:
        if config.duration is not None:
            try:
                async with asyncio.timeout(config.duration):
                    await dispatch()
            except TimeoutError:
                pass  # no new requests after --duration; those in flight finish
        else:
            await dispatch()
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        if tasks:  # cancelled or failed: stop what is in flight before the session closes
            pending = list(tasks)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
    duration = time.perf_counter() - t0
    return BenchResult(config, model, results, duration)
