"""Benchmarks for motor._fast.sse: one SSE block through the first leg's failover bookkeeping,
the byte scanner (``StreamRecovery`` with ``EventScanner``; ``scanner,no_shapes``: every
event scanned in full, no event read from the last one's shape) against the JSON path
(``StreamRecovery(scan=False)``: orjson load, edit, dump).

Budget (issue 13): exact mid-stream failover "costs close to nothing": a token event with
``token_ids`` cut for the client under 1 us including the Python call on one core, at
least 3x under the JSON path; the first chat chunk with a 32k-token prompt's ids under
the JSON path's time.

Run::

    .venv/bin/python -m pytest bench/bench_sse.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
from __future__ import annotations

import orjson
import pytest

from motor._fast.sse import EventScanner
from motor.coordinator.recovery import StreamRecovery

pytestmark = pytest.mark.fast_core

_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
         "max_tokens": 1 << 20}


def _chunk(content: str, ids: list[int] | None, **top: object) -> bytes:
    c: dict[str, object] = {"index": 0, "delta": {"content": content}, "logprobs": None,
                            "finish_reason": None}
    if ids is not None:
        c["token_ids"] = ids
    obj = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
           "created": 1764590000, "model": "Qwen/Qwen3-8B", **top, "choices": [c]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


#: (block, whether it is the stream's first)
EVENTS = {
    "token,ids": (_chunk(" the", [279]), False),           # vLLM with return_token_ids
    "token,no_ids": (_chunk(" the", None), False),         # an engine without token ids
    "4_tokens,ids": (b"".join(_chunk(" t", [100 + i]) for i in range(4)), False),
    "first,prompt=1k": (_chunk("", None, prompt_token_ids=list(range(1000, 2000))), True),
    "first,prompt=32k": (_chunk("", None, prompt_token_ids=list(range(32768))), True),
}


def _stream(impl: str, first: bool) -> StreamRecovery:
    r = StreamRecovery(True, _BODY, scan=impl != "json")
    if impl == "scanner,no_shapes":     # every event scanned in full (no EventScanner shape)
        r.scanner = EventScanner(True, False, shapes=False)
    if not first:         # past the first event: id known, role sent
        r.feed(_chunk("", [1], prompt_token_ids=[1, 2, 3]))
    return r


@pytest.mark.parametrize("impl", ["scanner", "scanner,no_shapes", "json"])
@pytest.mark.parametrize("event", sorted(EVENTS))
def test_feed(benchmark, event, impl):
    benchmark.group = f"sse.feed[{event}]"
    block, first = EVENTS[event]
    r = _stream(impl, first)
    if first:
        # a fresh stream per round: the prompt ids are read once per stream
        def run() -> bytes:
            return StreamRecovery(True, _BODY, scan=impl != "json").feed(block)
        out = benchmark(run)
    else:
        gen = r.gen

        def run() -> bytes:
            del gen[:]        # the stream's ids grow without bound otherwise
            return r.feed(block)
        out = benchmark(run)
    assert b"token_ids" not in out and b"prompt_token_ids" not in out
    if impl != "json":
        assert r.scanner is not None and r.scanner.fallbacks == 0
        if not first:
            # the block once more (--benchmark-disable runs it once): a repeated event is
            # read from the kept shape, unless shapes are off
            r.feed(block)
            assert (r.scanner.shaped > 0) == (impl == "scanner")
