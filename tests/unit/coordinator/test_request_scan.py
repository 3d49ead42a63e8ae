"""The request path reads a body in place (``motor._fast.reqscan``) and parses it only when
something needs the dict: a round-robin request answered whole never parses it, a
recoverable stream parses it once, and every body the scan hands back gets the same 400
answers as before, through a real coordinator in front of a fake engine."""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from motor.config.schema import Role
from motor.coordinator.routing import base
from tests.support.fake_backend import FakeBackend
from tests.support.gateway import Gateway, http, run_async

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class _CountingOrjson:
    """``orjson`` as ``routing.base`` sees it, counting ``loads`` calls."""

    JSONDecodeError = orjson.JSONDecodeError

    def __init__(self) -> None:
        self.loads_calls = 0

    def loads(self, raw: Any) -> Any:
        self.loads_calls += 1
        return orjson.loads(raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)


async def _post(body: bytes, path: str = "/v1/chat/completions"
                ) -> tuple[int, bytes, int]:
    """(status, answer body, ``orjson.loads`` calls in ``routing.base``) of one request."""
    fb = await FakeBackend().start()
    gw = Gateway([(Role.UNION, "127.0.0.1", fb.port)])
    await gw.start()
    counting = _CountingOrjson()
    mp = pytest.MonkeyPatch()
    mp.setattr(base, "orjson", counting)
    try:
        status, _, data = await http(gw.port, "POST", path, body,
                                     {"content-type": "application/json"})
    finally:
        mp.undo()
        await gw.stop()
        await fb.stop()
    return status, data, counting.loads_calls


@run_async
async def test_a_whole_answer_never_parses_the_body() -> None:
    status, data, loads = await _post(orjson.dumps(CHAT))
    assert status == 200 and orjson.loads(data)["choices"]
    assert loads == 0


@run_async
async def test_a_plain_recoverable_stream_never_parses_the_body() -> None:
    """Nothing a stream's failover set-up reads but the length bound: set up from the scan
    (the body is parsed only if a continuation is built)."""
    status, data, loads = await _post(orjson.dumps(dict(CHAT, stream=True)))
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
    assert loads == 0


@pytest.mark.parametrize("extra", [{"stream_options": {"include_usage": True}},
                                   {"stop": None}, {"max_tokens": 2.0}])
@run_async
async def test_a_stream_with_more_to_read_parses_the_body_once(extra: dict[str, Any]) -> None:
    status, data, loads = await _post(orjson.dumps(dict(CHAT, stream=True, **extra)))
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
    assert loads == 1


@pytest.mark.parametrize("body,message", [
    (b"{not json", "request body is not valid JSON"),
    (b"[1]", "request body is expected to be a JSON object, got an array"),
    (orjson.dumps(dict(CHAT, model=3)), "model is expected to be a string, got int"),
    (orjson.dumps(dict(CHAT, messages=[])),
     "messages is expected to be a non-empty array of messages, got an empty array"),
    (orjson.dumps({"model": "m"}),
     "messages is expected to be a non-empty array of messages, got no messages field"),
])
@run_async
async def test_bodies_the_scan_hands_back_get_the_same_400(body: bytes, message: str) -> None:
    status, data, loads = await _post(body)
    assert status == 400
    assert orjson.loads(data)["error"]["message"].startswith(message)
    assert loads == 1


def test_parsed_body_is_parsed_on_first_use_and_kept() -> None:
    raw = orjson.dumps(CHAT)
    p = base.Parsed(raw, None, "m", [], b"r", True, 0.0, True, 2)   # as the scan read it
    assert p.stream and p.max_tokens == 2
    assert p.info().prompt_tokens == max(1, len(raw) // 4)
    b = p.body
    assert b == orjson.loads(raw) and p.body is b
    ids = orjson.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    q = base.Parsed(ids, orjson.loads(ids), "m", [], b"r", False, 0.0)   # handed back
    assert not q.stream and q.max_tokens == 4
    assert q.info().prompt_tokens == 3                         # a token-id prompt's length
