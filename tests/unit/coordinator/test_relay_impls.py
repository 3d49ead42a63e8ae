"""The compiled SSE relay (motor._fast.relay) against the reference
(``motor.coordinator.routing.base.relay_sse_py``), both over the compiled client's answer
from a scripted raw-socket engine: the same writes to the client, the same returned error
and ``wrote`` flag, the same calls of the TTFT / TPOT / first-event / prefill-done hooks."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from motor._fast import relay as crelay
from motor.coordinator.routing import base
from motor.http.client import COMPILED_POOL

pytestmark = pytest.mark.skipif(COMPILED_POOL is None, reason="extensions not built")

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
END = b"0\r\n\r\n"

#: (steps: bytes to send or a pause in seconds or "close"; idle step s; idle timeout s; rec)
SCRIPTS: dict[str, tuple[list[Any], float, float, bool]] = {
    "events": ([HEAD, chunk(ROLE), 0.01, chunk(TOK), 0.01, chunk(TOK), chunk(DONE), END],
               1.0, 5.0, False),
    "events-fed": ([HEAD, chunk(ROLE), 0.01, chunk(TOK), 0.01, chunk(TOK + DONE), END],
                   1.0, 5.0, True),
    "split-events": ([HEAD, chunk(TOK[:10]), 0.01, chunk(TOK[10:] + TOK[:30]), 0.01,
                      chunk(TOK[30:] + DONE), END], 1.0, 5.0, True),
    "tail-without-blank-line": ([HEAD, chunk(TOK), 0.01, chunk(b"data: last"), END],
                                1.0, 5.0, False),
    "tail-fed": ([HEAD, chunk(TOK), 0.01, chunk(b"data: last"), END], 1.0, 5.0, True),
    "keep-alive-steps": ([HEAD, chunk(TOK), 0.25, chunk(TOK), END], 0.1, 5.0, False),
    "idle-timeout": ([HEAD, chunk(TOK), 1.0, chunk(TOK), END], 0.1, 0.3, False),
    "closed-mid-stream": ([HEAD, chunk(ROLE), 0.01, chunk(TOK), 0.01, "close"], 1.0, 5.0, True),
    "closed-before-event": ([HEAD, 0.01, "close"], 1.0, 5.0, False),
    "oversize-event": ([HEAD, chunk(b"data: " + b"x" * 300), 0.01, chunk(b"y" * 300), END],
                       1.0, 5.0, False),
    "only-role": ([HEAD, chunk(ROLE), 0.01, chunk(DONE), END], 1.0, 5.0, False),
}


class _Resp:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def write(self, data: bytes) -> None:
        self.log.append(("write", bytes(data)))

    async def drain(self) -> None:
        self.log.append(("drain",))


class _Rec:
    """A feed that drops blocks holding only the role preamble and marks the rest."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def feed(self, block: bytes) -> bytes:
        self.log.append(("feed", block))
        return b"" if block == ROLE else b"<" + block + b">"


class _Hist:
    def __init__(self, log: list[Any], name: str) -> None:
        self.log = log
        self.name = name

    def observe(self, v: float) -> None:
        assert v >= 0
        self.log.append((self.name,))


class _Route:
    def __init__(self, log: list[Any]) -> None:
        self.ttft = _Hist(log, "route.ttft")


class _Timing:
    def __init__(self, log: list[Any]) -> None:
        self.ttft = _Hist(log, "timing.ttft")
        self.tpot = _Hist(log, "timing.tpot")


async def _play(relay: Any, steps: list[Any], step_s: float, idle_s: float,
                with_rec: bool) -> list[Any]:
    ended = asyncio.Event()

    async def engine(rd: asyncio.StreamReader, wr: asyncio.StreamWriter) -> None:
        try:
            await rd.readuntil(b"\r\n\r\n")
            for s in steps:
                if s == "close":
                    return
                if isinstance(s, float):
                    await wr.drain()
                    await asyncio.sleep(s)
                else:
                    wr.write(s)
            await wr.drain()
            await rd.read()         # until the client closes its end
        finally:
            wr.close()
            ended.set()

    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    assert COMPILED_POOL is not None
    pool = COMPILED_POOL("127.0.0.1", port)
    log: list[Any] = []
    try:
        up = await pool.request(b"POST", b"/v1/chat/completions", b"{}", [],
                                first_byte_timeout_s=2.0, idle_timeout_s=step_s)
        err, wrote = await relay(up, _Resp(log), _Rec(log) if with_rec else None,
                                 _Route(log), 0.0, True, idle_s,
                                 on_first=lambda: log.append(("first",)),
                                 on_prefill_done=lambda: log.append(("prefill_done",)),
                                 timing=_Timing(log))
        up.close()
        log.append(("end", None if err is None else (type(err).__name__, str(err)), wrote))
    finally:
        pool.close()
        await asyncio.wait_for(ended.wait(), 5)
        srv.close()
        await srv.wait_closed()
    return log


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_same_behaviour_as_the_reference(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    steps, step_s, idle_s, with_rec = SCRIPTS[case]
    if case == "oversize-event":    # both relays with a 256-byte event bound
        monkeypatch.setattr(base, "MAX_SSE_EVENT_BYTES", 256)
        crelay.bind(base.UpstreamTimeout, base.UpstreamClosed, base.Silence, base.past_prefill,
                    base.KEEPALIVE, 256)
    try:
        ref = asyncio.run(_play(base.relay_sse_py, steps, step_s, idle_s, with_rec))
        got = asyncio.run(_play(crelay.relay_sse, steps, step_s, idle_s, with_rec))
    finally:
        crelay.bind(base.UpstreamTimeout, base.UpstreamClosed, base.Silence, base.past_prefill,
                    base.KEEPALIVE, base.MAX_SSE_EVENT_BYTES)
    # writes may be cut differently only where the reads were: compare what the client saw
    assert _merged(got) == _merged(ref)
    assert got[-1] == ref[-1]
    assert ref[-1][0] == "end"


def _merged(log: list[Any]) -> tuple[bytes, list[Any]]:
    """The bytes written in order, and the other calls in order (writes taken out)."""
    return (b"".join(x[1] for x in log if x[0] == "write"),
            [x for x in log if x[0] not in ("write", "drain", "feed")])


def test_dispatch_by_the_answer_type() -> None:
    """``relay_sse`` takes the compiled relay for the compiled client's answer."""
    assert base._COMPILED_UP is not None
    steps, step_s, idle_s, _ = SCRIPTS["events"]
    log = asyncio.run(_play(base.relay_sse, steps, step_s, idle_s, False))
    assert log[-1] == ("end", None, True)
    assert crelay.bound()
