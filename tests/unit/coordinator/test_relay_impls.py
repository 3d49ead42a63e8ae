"""The compiled SSE relay (motor._fast.relay) against the reference
(``motor.coordinator.routing.base.relay_sse_py``), both over the compiled client's answer
from a scripted raw-socket engine: the same writes to the client, the same returned error
and ``wrote`` flag, the same calls of the TTFT / TPOT / first-event / prefill-done hooks.
Each with a client whose ``drain`` is a coroutine, the compiled server's ready awaitable
(the compiled relay then takes pieces in the connection's ``data_received``), or now and
then a real wait (a slow client: the relay's task wakes to wait, then takes pieces so
again)."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from motor._fast import relay as crelay
from motor._fast.http1 import READY
from motor.coordinator.recovery import StreamRecovery
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


DRAINS = ("coroutine", "ready", "slow")


class _Resp:
    def __init__(self, log: list[Any], drains: str) -> None:
        self.log = log
        self.drains = drains
        self.n = 0

    def write(self, data: bytes) -> None:
        self.log.append(("write", bytes(data)))

    def drain(self) -> Any:
        self.log.append(("drain",))
        self.n += 1
        if self.drains == "ready" or (self.drains == "slow" and self.n % 2):
            return READY
        return self._wait()

    async def _wait(self) -> None:
        if self.drains == "slow":
            await asyncio.sleep(0.002)


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
                with_rec: bool, drains: str = "coroutine",
                rec: Any = None) -> tuple[list[Any], int]:
    """The relay's calls over the scripted answer, and the pieces the connection's sink
    took (``UpstreamResponse.pumped``). ``rec``: the feed (default: ``_Rec`` when
    ``with_rec``)."""
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
        if rec is None and with_rec:
            rec = _Rec(log)
        err, wrote = await relay(up, _Resp(log, drains), rec,
                                 _Route(log), 0.0, True, idle_s,
                                 on_first=lambda: log.append(("first",)),
                                 on_prefill_done=lambda: log.append(("prefill_done",)),
                                 timing=_Timing(log))
        up.close()
        pumped = up.pumped
        log.append(("end", None if err is None else (type(err).__name__, str(err)), wrote))
    finally:
        pool.close()
        await asyncio.wait_for(ended.wait(), 5)
        srv.close()
        await srv.wait_closed()
    return log, pumped


def _bind(max_event_bytes: int) -> None:
    crelay.bind(base.UpstreamTimeout, base.UpstreamClosed, base.Silence,
                base.KEEPALIVE, max_event_bytes, READY)


@pytest.mark.parametrize("drains", DRAINS)
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_same_behaviour_as_the_reference(case: str, drains: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    steps, step_s, idle_s, with_rec = SCRIPTS[case]
    if case == "oversize-event":    # both relays with a 256-byte event bound
        monkeypatch.setattr(base, "MAX_SSE_EVENT_BYTES", 256)
        _bind(256)
    try:
        ref, _ = asyncio.run(_play(base.relay_sse_py, steps, step_s, idle_s, with_rec, drains))
        got, pumped = asyncio.run(_play(crelay.relay_sse, steps, step_s, idle_s, with_rec,
                                        drains))
    finally:
        _bind(base.MAX_SSE_EVENT_BYTES)
    # writes may be cut differently only where the reads were: compare what the client saw
    assert _merged(got) == _merged(ref)
    assert got[-1] == ref[-1]
    assert ref[-1][0] == "end"
    if drains == "ready" and case in ("events", "events-fed", "split-events"):
        # pieces after a pause arrive while the relay waits: taken without waking it
        assert pumped >= 1


def _merged(log: list[Any]) -> tuple[bytes, list[Any]]:
    """The bytes written in order, and the other calls in order (writes taken out)."""
    return (b"".join(x[1] for x in log if x[0] == "write"),
            [x for x in log if x[0] not in ("write", "drain", "feed")])


def test_dispatch_by_the_answer_type() -> None:
    """``relay_sse`` takes the compiled relay for the compiled client's answer."""
    assert base._COMPILED_UP is not None
    steps, step_s, idle_s, _ = SCRIPTS["events"]
    log, _ = asyncio.run(_play(base.relay_sse, steps, step_s, idle_s, False))
    assert log[-1] == ("end", None, True)
    assert crelay.bound()


BYTES = st.lists(st.sampled_from([b"\n", b"\n\n", b"data:", b"[DONE]", b"x", b"da", b"ta:",
                                  b"[DO", b"NE]", b"\r"]), max_size=30).map(b"".join)


@given(BYTES)
def test_the_relays_block_cut_is_rfind(b: bytes) -> None:
    assert crelay.last_blank_line(b) == b.rfind(b"\n\n")


@given(BYTES, st.sampled_from([b"data:", b"[DONE]", b"\n", b"aa"]))
def test_the_relays_event_count_is_count(b: bytes, needle: bytes) -> None:
    assert crelay.count(b, needle) == b.count(needle)


def _vllm(content: str, ids: list[int], finish: str | None = None, odd: bool = False) -> bytes:
    """A vLLM chat chunk; ``odd``: with a number the byte scanner does not read (an
    exponent of 3 digits: it gives the block back to the JSON path)."""
    c = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish,
         "token_ids": ids}
    ev = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                       "model": "m", "choices": [c]})
    return b"data: " + (b'{"x":1e100,' + ev[1:] if odd else ev) + b"\n\n"


#: a recoverable stream's first leg (vLLM chunks with token ids): every piece the byte
#: scanner takes; one it gives back (a number it does not read: the JSON path) mid-stream
RECOVERABLE = {
    "scanned": [chunk(_vllm("", [])), 0.01, chunk(_vllm("a", [1])), 0.01,
                chunk(_vllm("b", [2]) + _vllm("c", [3])), 0.01,
                chunk(_vllm("", [4], "length") + DONE), END],
    "given-back": [chunk(_vllm("a", [1])), 0.01, chunk(_vllm("b", [2], odd=True)),
                   0.01, chunk(_vllm("c", [3])), 0.01, chunk(_vllm("", [4], "stop") + DONE),
                   END],
    "broken": [chunk(_vllm("a", [1])), 0.01, chunk(_vllm("b", [2])), 0.01, "close"],
}


@pytest.mark.parametrize("drains", DRAINS)
@pytest.mark.parametrize("case", sorted(RECOVERABLE))
def test_a_recoverable_stream_reads_the_same_through_both_relays(case: str,
                                                                drains: str) -> None:
    """The compiled relay calls the first leg's scanner itself (``scanning``): the client
    gets the same bytes and the recovery the same state as through ``rec.feed``."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    steps = [HEAD, *RECOVERABLE[case]]
    recs = [StreamRecovery(True, body), StreamRecovery(True, body)]
    ref, _ = asyncio.run(_play(base.relay_sse_py, steps, 1.0, 5.0, True, drains, recs[0]))
    got, _ = asyncio.run(_play(crelay.relay_sse, steps, 1.0, 5.0, True, drains, recs[1]))
    assert _merged(got) == _merged(ref)
    assert got[-1] == ref[-1]
    a, b = (_rec_state(r) for r in recs)
    assert a == b
    assert a["gen"] == ([1, 2] if case == "broken" else [1, 2, 3, 4])
    assert (recs[1].scanner.fallbacks == 1) == (case == "given-back")
    assert b"token_ids" not in _merged(got)[0]


def _rec_state(r: StreamRecovery) -> dict[str, Any]:
    return {k: getattr(r, k) for k in ("gen", "finished", "done", "finish_reason", "resp_id",
                                       "role_sent", "ids_missing")} | {"leg_end": r.leg_end()}
