"""Benchmarks for motor._fast.reqscan: what the request path reads of a body before it sends
it (``model``, ``stream``, the length bound, a chat's ``messages`` non-empty), by the
in-place scan (``scan_request``, every byte checked by ``motor._fast.jsongrammar``)
against a parse (``orjson.loads``, then the same reads), on the peer harness's chat body
(1 KB system prompt, ``bench/kv_proxy_cost.py``'s) and a 32 KB one.

Budget (issue 13): under half the parse's time on the harness's body (a round-robin
request answered whole parses nothing else).

Run::

    .venv/bin/python -m pytest bench/bench_reqscan.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from kv_proxy_cost import body
from motor._fast.reqscan import scan_request
from motor.protocol.openai import max_tokens_of

pytestmark = pytest.mark.fast_core

BODIES = {
    "chat_1k": body(7),
    "chat_32k": orjson.dumps({"model": "m", "max_tokens": 16, "messages": [
        {"role": "user", "content": "word " * 6500}]}),
}


def _parse(raw: bytes) -> tuple[Any, bool, int]:
    b = orjson.loads(raw)
    msgs = b.get("messages")
    assert type(msgs) is list and msgs
    return b.get("model"), b.get("stream") is True, max_tokens_of(b, True)


@pytest.mark.parametrize("impl", ["scan", "orjson"])
@pytest.mark.parametrize("name", sorted(BODIES))
def test_request_head(benchmark, impl: str, name: str) -> None:
    raw = BODIES[name]
    fn = (lambda: scan_request(raw, True)) if impl == "scan" else (lambda: _parse(raw))
    got = benchmark(fn)
    assert got is not None and tuple(got[:3]) == _parse(raw)   # the scan adds plain, bound
