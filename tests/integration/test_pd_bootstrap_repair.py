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


@pytest.mark.parametrize("kind", ["no_body", "sse_forever"])
@run_async
async def test_a_decode_refusal_whose_body_never_ends_is_not_waited_for(kind: str) -> None:
    """A D answering 503 with a body that never comes (or an error stream that never ends):
    the body is never relayed (another pair follows), so the next pair answers at once
    instead of the request waiting for that body (helper-15's review)."""
    import asyncio

    from motor.config.schema import Role
    from motor.sim.engine import EngineConfig
    from motor.sim.options import PdOptions, SimOptions
    from motor.sim.server import SimServer
    from tests.support.gateway import Gateway

    hits: list[bytes] = []

    async def refusing_decode(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        n = int(h.split(b":")[1])
                await r.readexactly(n)
                path = head.split(b"\r\n")[0].split()[1]
                if not path.startswith(b"/v1/completions"):
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}")
                    await w.drain()
                    continue
                hits.append(path)
                if kind == "no_body":
                    w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: "
                            b"application/json\r\ncontent-length: 100\r\n\r\n")
                    await w.drain()
                    await asyncio.sleep(30)
                else:
                    w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: "
                            b"text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    for _ in range(100):
                        ev = b'data: {"error":{"message":"overloaded","code":503}}\n\n'
                        w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                        await w.drain()
                        await asyncio.sleep(0.3)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(refusing_decode, "127.0.0.1", 0)
    sims = [SimServer(SimOptions(port=0, role=role, model="m",
                                 engine=EngineConfig(time_scale=0.05),
                                 pd=PdOptions(bootstrap_timeout_s=3.0)))
            for role in ("prefill", "decode")]
    for s in sims:
        await s.start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", sims[0].port),
                        (Role.DECODE, "127.0.0.1", srv.sockets[0].getsockname()[1]),
                        (Role.DECODE, "127.0.0.1", sims[1].port)],
                       mode="pd_bootstrap", retries={"max_attempts": 3, "backoff_s": 0.0},
                       timeouts={"idle_s": 30.0}).start()
    try:
        for stream in (False, True):
            req = {"model": "m", "prompt": "hi " * 10, "max_tokens": 6, "ignore_eos": True,
                   "stream": stream}
            st, _, body = await http(gw.port, "POST", "/v1/completions", orjson.dumps(req),
                                     timeout=8)
            assert st == 200, body
            assert _tokens(stream, body) == 6
        assert hits        # the refusing D was tried (round robin: every other pair)
        assert gw.inflight() == 0
    finally:
        await gw.stop()
        for s in sims:
            await s.stop(0.2)
        srv.close()
