"""``pd_bootstrap``: a pair whose leg failed before anything reached the client is chosen
again (a new bootstrap room), avoiding the instance that failed: P answering a retryable
status, D answering one, P refusing the connection. The pair shares P's room, so neither
leg can move alone; the last pair's failure is the client's answer."""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from motor.coordinator import metrics
from tests.integration.test_pd import Cluster, _events
from tests.support.gateway import http, run_async


def _retries(reason: str) -> float:
    return metrics.RETRIES.labels(reason)._value.get()


def _rooms(c: Cluster, role: str) -> list[int]:
    return [b["bootstrap_room"] for _, b in c.log(role)]


async def _ask(c: Cluster, stream: bool) -> tuple[int, bytes]:
    req = {"model": "m", "prompt": "hi " * 10, "max_tokens": 6, "ignore_eos": True,
           "stream": stream}
    st, _, body = await http(c.gw.port, "POST", "/v1/completions", orjson.dumps(req),
                             timeout=20)
    return st, body


def _tokens(stream: bool, body: bytes) -> int:
    if not stream:
        return int(orjson.loads(body)["usage"]["completion_tokens"])
    evs = _events(body)
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1, body
    assert not any("error" in e for e in evs[:-1]), body
    return sum(1 for e in evs[:-1] if e["choices"][0]["text"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ["prefill", "decode"])
@run_async
async def test_a_retryable_status_of_either_leg_chooses_a_new_pair(role: str,
                                                                   stream: bool) -> None:
    c = await Cluster("pd_bootstrap", retries={"max_attempts": 3, "backoff_s": 0.0}).start()
    try:
        for i in range(2):      # each instance of the role answers 503 once
            c.sim(role, i).faults.set({"mode": "error", "status": 503, "count": 1})
        before = _retries("status_503")
        st, body = await _ask(c, stream)
        assert st == 200, body
        assert _tokens(stream, body) == 6          # one answer, no token twice
        assert _retries("status_503") - before == 2
        assert len(c.log(role)) == 3               # 503, 503 (the other one), the answer
        rooms = _rooms(c, "prefill")
        assert len(rooms) == 3 and len(set(rooms)) == 3, rooms   # a new room each pair
        d_rooms = _rooms(c, "decode")   # a D whose P failed first may not have been sent
        assert set(d_rooms) <= set(rooms) and d_rooms[-1] == rooms[-1]
        assert c.gw.inflight() == 0
    finally:
        await c.stop()


@run_async
async def test_the_last_pairs_retryable_status_is_the_clients_answer() -> None:
    c = await Cluster("pd_bootstrap", retries={"max_attempts": 2, "backoff_s": 0.0}).start()
    try:
        for i in range(2):
            c.sim("decode", i).faults.set({"mode": "error", "status": 503, "count": 2})
        st, body = await _ask(c, False)
        assert st == 503, body
        assert "error" in orjson.loads(body)
        assert len(c.log("decode")) == 2 and len(set(_rooms(c, "decode"))) == 2
    finally:
        await c.stop()


@run_async
async def test_a_prefill_that_refuses_connections_is_avoided_by_the_next_pair() -> None:
    c = await Cluster("pd_bootstrap", retries={"max_attempts": 2, "backoff_s": 0.0}).start()
    try:
        dead = c.sim("prefill", 0)
        await dead.stop(0.2)            # its port now refuses connections
        before = _retries("connect")
        answers: list[Any] = []
        for i in range(4):              # round robin: P0 comes up for some of them
            st, body = await _ask(c, bool(i % 2))
            assert st == 200, body
            answers.append(_tokens(bool(i % 2), body))
        assert answers == [6, 6, 6, 6]
        assert _retries("connect") - before >= 1
        assert len(c.log("prefill")) == 4         # every answer from the live P
        assert c.gw.inflight() == 0
    finally:
        c.sims.remove(dead)
        await c.stop()
