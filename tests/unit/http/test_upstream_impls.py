"""The compiled pooled client (motor._fast.upstream) against the pure-Python reference
(motor.http.client): the same scripted raw-socket servers give the same observations,
byte for byte, on asyncio's loop and uvloop.

An observation log holds what a caller of the pool sees (status, headers, body pieces,
the exception raised with its attributes, the pool's counters) and what the server saw
(the request bytes, per connection, and how many connections were opened). Body pieces are
compared piece by piece only where the server waits for the client to take a piece before
it sends the next (``("wait", n)``), elsewhere joined (the socket may coalesce writes).
A hypothesis test feeds response-like garbage cut at random points to both connection
protocols over an in-memory transport and requires the same pieces, errors and closing."""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trustme
import uvloop
from hypothesis import HealthCheck, given, settings, strategies as st

from motor._fast import upstream
from motor.http import client
from motor.http.client import UpstreamClosed, UpstreamEvicted, UpstreamTimeout

IMPLS: dict[str, Any] = {"python": client.Pool, "compiled": upstream.Pool}
CONNS: dict[str, Any] = {"python": client._Conn, "compiled": upstream.Conn}
RESPS: dict[str, Any] = {"python": client.UpstreamResponse,
                         "compiled": upstream.UpstreamResponse}

Script = list[tuple[Any, ...]]


class FakeServer:
    """A raw-socket HTTP server that plays ``scripts[i]`` on its ``i``-th connection (the
    last script again for later ones). Steps: ``("req",)`` read one request (head and a
    content-length body) into :attr:`received`; ``("send", bytes)``; ``("pause", s)``;
    ``("wait", n)`` until the client took ``n`` body pieces (:meth:`took`); ``("close",)``;
    ``("abort",)``; ``("hang",)`` until the server stops."""

    def __init__(self, scripts: list[Script], tls: ssl.SSLContext | None = None) -> None:
        self.scripts = scripts
        self.tls = tls
        self.received: list[list[bytes]] = []
        self.eof: list[bool] = []
        self.pieces = 0
        self._took = asyncio.Event()
        self._stop = asyncio.Event()
        self._srv: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> int:
        self._srv = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._srv.sockets[0].getsockname()[1]
        return self.port

    def took(self) -> None:
        self.pieces += 1
        self._took.set()

    async def _serve(self, rd: asyncio.StreamReader, wr: asyncio.StreamWriter) -> None:
        i = len(self.received)
        self.received.append([])
        self.eof.append(False)
        t = asyncio.current_task()
        assert t is not None
        self._tasks.add(t)
        try:
            for step in self.scripts[min(i, len(self.scripts) - 1)]:
                op = step[0]
                if op == "req":
                    head = await rd.readuntil(b"\r\n\r\n")
                    n = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            n = int(line.split(b":", 1)[1])
                    self.received[i].append(head + await rd.readexactly(n))
                elif op == "send":
                    wr.write(step[1])
                    await wr.drain()
                elif op == "pause":
                    await asyncio.sleep(step[1])
                elif op == "wait":
                    while self.pieces < step[1]:
                        self._took.clear()
                        await self._took.wait()
                elif op == "close":
                    wr.close()
                    return
                elif op == "abort":
                    wr.transport.abort()
                    return
                elif op == "hang":
                    await self._stop.wait()
                    return
            # script done: note whether the client closed its end
            read = asyncio.ensure_future(rd.read())
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait((read, stop), return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if read.done():
                self.eof[i] = read.result() == b""
            else:
                read.cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof[i] = True
        finally:
            self._tasks.discard(t)
            wr.close()

    async def stop(self) -> None:
        assert self._srv is not None
        self._srv.close()
        self._stop.set()
        for _ in range(100):
            if not self._tasks:
                break
            await asyncio.sleep(0.002)


def err(e: BaseException) -> tuple[Any, ...]:
    """An exception as compared: its class, message, and the client's attributes."""
    out: tuple[Any, ...] = (type(e).__name__, str(e))
    if isinstance(e, UpstreamTimeout):
        out += ("timeout", e.phase, e.timeout_s)
    if isinstance(e, UpstreamClosed):
        out += ("closed", e.before_response)
    if isinstance(e, UpstreamEvicted):
        out += ("evicted", e.reason)
    return out


OK_5 = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Up: A\r\nx-up: b\r\n\r\nhello"
OK_BYE = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbye"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" \
               b"transfer-encoding: chunked\r\n\r\n"


class Run:
    """One scenario on one implementation: its pool, its server, its log."""

    def __init__(self, impl: str, server: FakeServer, **pool_kw: Any) -> None:
        self.impl = impl
        self.server = server
        self.pool_kw = pool_kw
        self.log: list[Any] = []
        self.pool: Any = None

    def stats(self, tag: str = "pool") -> None:
        self.log.append((tag, self.pool.open_connections, self.pool.idle_connections))

    async def request(self, method: bytes = b"POST", path: bytes = b"/v1/x", body: bytes = b"{}",
                      headers: Any = ((b"content-type", b"application/json"),),
                      mode: str = "read", **kw: Any) -> Any:
        """One request, its answer consumed by ``mode`` (``read``, ``now``: ``read_now``
        then ``read``, ``iter``, ``next``, ``lockstep``, ``none``: left open); logged."""
        try:
            r = await self.pool.request(method, path, body, headers, **kw)
        except (UpstreamTimeout, UpstreamClosed, UpstreamEvicted, OSError) as e:
            self.log.append(("request-error", err(e)))
            return None
        self.log.append(("answer", r.status, list(r.headers), r.header(b"x-up"),
                         r.header(b"nope", b"dflt")))
        try:
            if mode == "read":
                body = await r.read()
                self.log.append(("body", body if len(body) < 4096 else (len(body), hash(body))))
            elif mode == "now":     # read_now, then read when the body was not all there
                now = r.read_now()
                self.log.append(("now", now is not None))
                body = now if now is not None else await r.read()
                self.log.append(("body", body if len(body) < 4096 else (len(body), hash(body))))
                self.log.append(("again", r.read_now()))     # done: None
            elif mode == "iter":
                self.log.append(("body", b"".join([c async for c in r])))
            elif mode == "lockstep":
                while (c := await r.next_chunk()) is not None:
                    self.log.append(("piece", c))
                    self.server.took()
                self.log.append(("end",))
            elif mode == "next":
                self.log.append(("piece", await r.next_chunk()))
                return r
            else:
                return r
        except (UpstreamTimeout, UpstreamClosed, OSError) as e:
            self.log.append(("body-error", err(e)))
            r.close()
        return None


Scenario = Callable[[Run], Awaitable[None]]


async def play(impl: str, scripts: list[Script], scenario: Scenario, tls: Any = None,
               **pool_kw: Any) -> list[Any]:
    server = FakeServer(scripts, tls[0] if tls else None)
    port = await server.start()
    run = Run(impl, server, **pool_kw)
    run.pool = IMPLS[impl]("127.0.0.1", port, tls=tls[1] if tls else None, **pool_kw)
    try:
        await asyncio.wait_for(scenario(run), 10)
        run.stats("end")
        run.pool.close()
        for _ in range(20):
            await asyncio.sleep(0.005)
        run.stats("closed")
    finally:
        await server.stop()
    text = repr(run.log).replace(str(port), "PORT")
    received = [[r.replace(b"%d" % port, b"PORT") for r in c] for c in server.received]
    return [text, received, len(server.received), server.eof]


def sequential(*modes: str, gap: float = 0.0, **kw: Any) -> Scenario:
    """Requests one after the other, one per mode, the pool's counters after each (and
    ``gap`` seconds later)."""
    async def go(run: Run) -> None:
        for m in modes:
            await run.request(mode=m, **kw)
            run.stats()
            if gap:
                await asyncio.sleep(gap)
                run.stats("later")
    return go


CASES: dict[str, tuple[list[Script], Scenario, dict[str, Any]]] = {
    "keepalive-reuse": ([[("req",), ("send", OK_5)] * 3],
                        sequential("read", "iter", "read"), {}),
    "split-head-and-body": ([[("req",)] + [("send", OK_5[i:i + 7]) for i in range(0, len(OK_5), 7)]
                             + [("req",), ("send", OK_5)]],
                            sequential("read", "read"), {}),
    "chunked-split": ([[("req",), ("send", CHUNKED_HEAD[:20]), ("pause", 0.01),
                        ("send", CHUNKED_HEAD[20:] + b"5\r\nab"), ("pause", 0.01),
                        ("send", b"cde\r\n1"), ("send", b"0\r\n" + b"x" * 16 + b"\r\n0\r\n"),
                        ("pause", 0.01), ("send", b"\r\n"), ("req",), ("send", OK_5)]],
                      sequential("iter", "read"), {}),
    "chunked-lockstep": ([[("req",), ("send", CHUNKED_HEAD + b"3\r\nabc\r\n"), ("wait", 1),
                           ("send", b"2\r\nde\r\n"), ("wait", 2),
                           ("send", b"4\r\nfghi\r\n0\r\n\r\n")]],
                         sequential("lockstep"), {}),
    "close-delimited": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\nx-up: c\r\n\r\nab"),
                          ("pause", 0.01), ("send", b"cd"), ("close",)]],
                        sequential("read", "read"), {}),
    "http10-answer": ([[("req",), ("send", b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"),
                        ("hang",)]], sequential("read", "read"), {}),
    "connection-close-header": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
                                                     b"connection: close\r\n\r\nok")]],
                                sequential("read", "read"), {}),
    "no-body-statuses": ([[("req",), ("send", b"HTTP/1.1 204 No Content\r\n\r\n"), ("req",),
                           ("send", b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n"),
                           ("req",), ("send", OK_5)]],
                         sequential("read", "read", "read"), {}),
    "interim-100": ([[("req",), ("send", b"HTTP/1.1 100 Continue\r\n\r\n" + OK_5), ("req",),
                      ("send", OK_BYE)]], sequential("read", "read"), {}),
    "interim-103-alone": ([[("req",), ("send", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"),
                            ("pause", 0.02), ("send", OK_5), ("req",),
                            ("send", b"HTTP/1.1 100 Continue\r\n\r\n"), ("pause", 0.02),
                            ("send", OK_BYE)]], sequential("read", "read"), {}),
    "switching-protocols": ([[("req",), ("send", b"HTTP/1.1 101 Switching Protocols\r\n"
                                                 b"connection: upgrade\r\nupgrade: x\r\n\r\n"),
                              ("hang",)]], sequential("read"), {}),
    "closed-mid-body": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"
                                             b"abcd"), ("pause", 0.01), ("close",)]],
                        sequential("read"), {}),
    "closed-mid-chunked": ([[("req",), ("send", CHUNKED_HEAD + b"3\r\nabc\r\n"),
                             ("pause", 0.01), ("abort",)]], sequential("iter"), {}),
    "closed-mid-head": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-le"), ("pause", 0.01),
                          ("close",)]], sequential("read"), {}),
    "closed-before-answer-fresh": ([[("req",), ("close",)]], sequential("read"), {}),
    "stale-keepalive-retried": ([[("req",), ("send", OK_5), ("req",), ("close",)],
                                 [("req",), ("send", OK_5)] * 2],
                                sequential("read", "read", "read"), {}),
    "stale-keepalive-retry-fails": ([[("req",), ("send", OK_5), ("req",), ("close",)],
                                     [("req",), ("close",)]],
                                    sequential("read", "read"), {}),
    "partial-answer-not-retried": ([[("req",), ("send", OK_5), ("req",), ("send", b"HTTP/1.1 "),
                                     ("pause", 0.01), ("close",)], [("req",), ("send", OK_5)]],
                                   sequential("read", "read"), {}),
    "engine-closes-idle": ([[("req",), ("send", OK_5), ("pause", 0.01), ("close",)],
                            [("req",), ("send", OK_5)]],
                           sequential("read", "read", gap=0.1), {}),
    "malformed-status": ([[("req",), ("send", b"HTTP/1.1 2x0 OK\r\n\r\n"), ("hang",)]],
                         sequential("read"), {}),
    "malformed-chunk": ([[("req",), ("send", CHUNKED_HEAD + b"3\r\nabc\r\nzz\r\n"), ("hang",)]],
                        sequential("read"), {}),
    "first-byte-timeout": ([[("req",), ("hang",)]],
                           sequential("read", first_byte_timeout_s=0.05), {}),
    "idle-timeout": ([[("req",), ("send", CHUNKED_HEAD + b"2\r\nab\r\n"), ("hang",)]],
                     sequential("read", idle_timeout_s=0.05), {}),
    "no-timeout-when-fast": ([[("req",), ("send", OK_5)] * 2],
                             sequential("read", "iter", first_byte_timeout_s=5,
                                        idle_timeout_s=5), {}),
    "max-idle-zero": ([[("req",), ("send", OK_5)]], sequential("read", "read"),
                      {"max_idle": 0}),
    "request-headers-and-get": ([[("req",), ("send", OK_5)] * 2],
                                sequential("read", method=b"GET", path=b"/health?x=1", body=b"",
                                           headers=[(b"X-Trace", b"t1"), (b"a", b"")]), {}),
    "body-over-high-water": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-length: 1572864"
                                                  b"\r\n\r\n" + b"x" * 1572864),
                               ("req",), ("send", OK_5)]], sequential("read", "read"), {}),
    "read-now-whole-with-head": ([[("req",), ("send", OK_5), ("req",),
                                   ("send", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
                                   ("req",), ("send", CHUNKED_HEAD + b"2\r\nab\r\n0\r\n\r\n")]],
                                 sequential("now", "now", "now"), {}),
    "read-now-body-later": ([[("req",), ("send", OK_5[:-2]), ("pause", 0.02),
                              ("send", OK_5[-2:]), ("req",), ("send", OK_BYE)]],
                            sequential("now", "now"), {}),
    "read-now-close-delimited": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\n\r\nab"),
                                   ("pause", 0.01), ("close",)], [("req",), ("send", OK_5)]],
                                 sequential("now", "now"), {}),
    "read-now-closed-mid-body": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-length: 9"
                                                      b"\r\n\r\nabc"), ("close",)],
                                  [("req",), ("send", OK_5)]], sequential("now", "now"), {}),
    "read-now-over-high-water": ([[("req",), ("send", b"HTTP/1.1 200 OK\r\ncontent-length: "
                                                      b"1572864\r\n\r\n" + b"x" * 1572864),
                                   ("req",), ("send", OK_5)]], sequential("now", "now"), {}),
    "left-open-then-closed": ([[("req",), ("send", CHUNKED_HEAD + b"1\r\na\r\n"), ("hang",)],
                               [("req",), ("send", OK_5)]],
                              sequential("next", "read"), {}),
}


async def _left_open(run: Run) -> None:
    r = await run.request(mode="next")
    run.stats("open")
    assert r is not None
    r.close()
    r.close()                       # idempotent
    run.stats("after-close")
    await run.request()
    run.stats()


async def _pool_wait(run: Run) -> None:
    first = await run.request(mode="none")
    run.stats("held")
    await run.request()             # max_connections=1, all busy: pool timeout
    run.stats("after-timeout")
    assert first is not None
    run.log.append(("body", await first.read()))
    await run.request()
    run.stats()


async def _waiters(run: Run) -> None:
    await asyncio.gather(*(run.request(mode="iter") for _ in range(4)))
    run.stats()


async def _close_with_waiters(run: Run) -> None:
    held = await run.request(mode="none")
    t = asyncio.ensure_future(run.request())
    await asyncio.sleep(0.01)
    run.pool.close()
    await t
    assert held is not None
    held.close()
    run.stats()


async def _refused(run: Run) -> None:
    p = IMPLS[run.impl]("127.0.0.1", _closed_port())
    try:
        await p.request(b"GET", b"/", b"")
    except OSError as e:
        run.log.append(("refused", type(e).__name__, isinstance(e, ConnectionRefusedError)))
    run.log.append(("refused-pool", p.open_connections, p.idle_connections))
    p.close()
    await run.request()


def _closed_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


CASES["left-open-then-closed"] = (CASES["left-open-then-closed"][0], _left_open, {})
CASES["pool-wait-timeout"] = ([[("req",), ("send", CHUNKED_HEAD + b"1\r\na\r\n"), ("pause", 0.2),
                                ("send", b"0\r\n\r\n"), ("req",), ("send", OK_5)]],
                              _pool_wait, {"max_connections": 1, "pool_wait_s": 0.05})
CASES["pool-waiters-served-in-turn"] = ([[("req",), ("send", CHUNKED_HEAD + b"1\r\na\r\n"),
                                          ("pause", 0.01), ("send", b"0\r\n\r\n")] * 4],
                                        _waiters, {"max_connections": 1})
CASES["pool-closed-with-waiters"] = ([[("req",), ("send", CHUNKED_HEAD), ("hang",)]],
                                     _close_with_waiters, {"max_connections": 1})
CASES["connection-refused"] = ([[("req",), ("send", OK_5)]], _refused, {})


async def _evict_waiting(run: Run) -> None:
    """Owner A's request waits for its head (connection 0 hangs), B's gets its answer
    later (connection 1): evicting A ends A's only, once; A's next request is served."""
    a, b = object(), object()
    ta = asyncio.ensure_future(run.request(owner=a))
    await asyncio.sleep(0.03)
    tb = asyncio.ensure_future(run.request(owner=b))
    await asyncio.sleep(0.03)
    run.log.append(("evict-none", run.pool.evict(None, UpstreamEvicted("no owner"))))
    run.log.append(("evict", run.pool.evict(a, UpstreamEvicted("instance left"))))
    run.log.append(("evict-again", run.pool.evict(a, UpstreamEvicted("again"))))
    await ta
    run.stats("after-evict")
    await tb
    run.stats()
    await run.request(owner=a)
    run.stats()


async def _evict_pool_waiters(run: Run) -> None:
    """One connection at most: A holds it (no answer), another A and a B wait for it;
    evicting A ends both A's, B gets the connection's place and its answer."""
    a, b = object(), object()
    t1 = asyncio.ensure_future(run.request(owner=a))
    await asyncio.sleep(0.03)
    t2 = asyncio.ensure_future(run.request(owner=a))
    t3 = asyncio.ensure_future(run.request(owner=b))
    await asyncio.sleep(0.03)
    run.stats("waiting")
    run.log.append(("evict", run.pool.evict(a, UpstreamEvicted("instance left"))))
    await t1
    await t2
    await t3
    run.stats()


async def _evict_woken_waiter(run: Run) -> None:
    """One connection at most: B (owner b) waits for it; A's answer read hands it back,
    which wakes B, and b is evicted before B resumes: B ends evicted all the same (it never
    sends), and the connection serves the next request."""
    a, b = object(), object()
    ra = await run.pool.request(b"POST", b"/v1/x", b"{}", (), owner=a)
    tb = asyncio.ensure_future(run.request(owner=b))
    await asyncio.sleep(0.03)
    run.stats("b-waiting")
    run.log.append(("a-body", ra.read_now()))       # the connection back: B woken
    run.log.append(("evict", run.pool.evict(b, UpstreamEvicted("instance left"))))
    await tb
    run.stats("after-evict")
    await run.request(owner=a)
    run.stats()


async def _closed_pool_release(run: Run) -> None:
    """The pool closes (its endpoint removed) while an answer is being read: the connection
    closes once that answer ends, not kept open for nobody."""
    r = await run.request(mode="next")
    assert r is not None
    run.pool.close()
    run.log.append(("rest", await r.read()))
    run.stats()


CASES["closed-pool-release"] = ([[("req",), ("send", CHUNKED_HEAD + b"1\r\na\r\n"),
                                  ("pause", 0.05), ("send", b"2\r\nbc\r\n0\r\n\r\n")]],
                                _closed_pool_release, {})
CASES["evict-woken-waiter"] = ([[("req",), ("send", OK_5), ("req",), ("send", OK_BYE)]],
                               _evict_woken_waiter, {"max_connections": 1})
CASES["evict-waiting-for-head"] = ([[("req",), ("hang",)],
                                    [("req",), ("pause", 0.1), ("send", OK_5), ("req",),
                                     ("send", OK_BYE)]], _evict_waiting, {})
CASES["evict-pool-waiters"] = ([[("req",), ("hang",)], [("req",), ("send", OK_5)]],
                               _evict_pool_waiters, {"max_connections": 1})


def run_loop(loop: str, coro: Callable[[], Awaitable[None]]) -> None:
    if loop == "uvloop":
        uvloop.run(coro())  # type: ignore[arg-type]
    else:
        asyncio.run(coro())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_observations_as_the_reference(case: str, loop: str) -> None:
    scripts, scenario, kw = CASES[case]

    async def go() -> None:
        py = await play("python", scripts, scenario, **kw)
        c = await play("compiled", scripts, scenario, **kw)
        assert c == py
    run_loop(loop, go)


def test_expected_observations() -> None:
    """Spot checks of what the reference (and so both) does, so equality is not vacuous."""
    async def go() -> None:
        text, received, conns, _ = await play("compiled", *CASES["stale-keepalive-retried"][:2])
        assert conns == 2 and len(received[0]) == 2 and received[0][1] == received[1][0]
        assert "request-error" not in text and text.count("b'hello'") == 3
        text, _, conns, _ = await play("compiled", *CASES["read-now-whole-with-head"][:2])
        # the body taken without a wait, the connection kept for the next request
        assert conns == 1 and text.count("('now', True)") == 3, text
        assert "('body', b'hello')" in text and "('body', b'ab')" in text
        text, _, _, _ = await play("compiled", *CASES["read-now-body-later"][:2])
        assert "('now', False), ('body', b'hello')" in text, text
        text, _, conns, _ = await play("compiled", *CASES["evict-waiting-for-head"][:2])
        assert conns == 2 and "('evict-none', 0), ('evict', 1), ('evict-again', 0)" in text, text
        assert text.count("'UpstreamEvicted', 'instance left', 'evicted', 'instance left'") == 1
        assert "('body', b'hello')" in text and "('body', b'bye')" in text
        text, _, conns, eof = await play("compiled", *CASES["closed-pool-release"][:2])
        assert "('rest', b'bc')" in text and conns == 1 and eof == [True], (text, eof)
        text, received, conns, _ = await play("compiled", *CASES["evict-woken-waiter"][:2],
                                              max_connections=1)
        assert conns == 1 and len(received[0]) == 2, (text, received)   # B never sent
        assert "('a-body', b'hello'), ('evict', 1)" in text and "('body', b'bye')" in text
        assert text.count("UpstreamEvicted") == 1
        text, _, conns, _ = await play("compiled", *CASES["evict-pool-waiters"][:2],
                                       max_connections=1)
        assert conns == 2 and "('evict', 2)" in text and "('body', b'hello')" in text, text
        assert text.count("UpstreamEvicted") == 2
        text, _, _, _ = await play("compiled", *CASES["stale-keepalive-retry-fails"][:2])
        assert "'closed', True" in text
        text, _, _, _ = await play("compiled", *CASES["closed-mid-body"][:2])
        assert "'closed', False" in text
        text, _, _, _ = await play("compiled", *CASES["first-byte-timeout"][:2])
        assert "'timeout', 'first byte', 0.05" in text
        text, _, _, _ = await play("compiled", *CASES["idle-timeout"][:2])
        assert "'timeout', 'idle', 0.05" in text
        for case in ("interim-100", "interim-103-alone"):    # a 1xx is not the answer
            text, _, conns, _ = await play("compiled", *CASES[case][:2])
            assert conns == 1 and "100" not in text and "103" not in text, text
            assert text.index("b'hello'") < text.index("b'bye'"), text
        text, _, _, _ = await play("compiled", *CASES["switching-protocols"][:2])
        assert "request-error" in text or "body-error" in text, text
        text, _, _, _ = await play("compiled", *CASES["close-delimited"][:2])
        assert "b'abcd'" in text
        scripts, scen, kw = CASES["pool-wait-timeout"]
        text, _, _, _ = await play("compiled", scripts, scen, **kw)
        assert "'timeout', 'pool', 0.05" in text
        text, received, _, _ = await play("compiled", *CASES["request-headers-and-get"][:2])
        assert received[0][0] == (b"GET /health?x=1 HTTP/1.1\r\nhost: 127.0.0.1:PORT\r\n"
                                  b"content-length: 0\r\nX-Trace: t1\r\na: \r\n\r\n")
    asyncio.run(go())


def test_tls_connections() -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def go() -> None:
        scripts: list[Script] = [[("req",), ("send", OK_5), ("req",),
                                  ("send", CHUNKED_HEAD + b"2\r\nab\r\n0\r\n\r\n")]]
        out = []
        for impl in ("python", "compiled"):
            out.append(await play(impl, scripts, sequential("read", "iter"),
                                  tls=(server_ctx, client_ctx)))
        assert out[0] == out[1]
        assert out[0][2] == 1 and "b'hello'" in out[0][0] and "b'ab'" in out[0][0]
    asyncio.run(go())


def test_compiled_module_interface() -> None:
    assert upstream.bound()
    assert client.COMPILED_POOL is upstream.Pool
    p = upstream.Pool("h", 1)
    assert (p.host, p.port, p.max_connections, p.connect_timeout_s, p.tls, p.pool_wait_s,
            p.max_idle, p.closed, p.open_connections, p.idle_connections) == \
        ("h", 1, 1024, 5.0, None, None, 1024, False, 0, 0)
    with pytest.raises(AttributeError):
        p.other = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        upstream.Conn(None)  # type: ignore[arg-type]
    c = client.Client()
    assert c.pool_class is client.POOL
    c.pool_class = client.Pool
    assert type(c.pool("h", 2)) is client.Pool
    c.close()


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.calls.append("write")

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
_PIECES = st.sampled_from([
    b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 200 OK\r\n", b"HTTP/1.1 204 No Content\r\n",
    b"HTTP/1.1 100 Continue\r\n", b"HTTP/1.1 5xx x\r\n", b"Content-Length: 3\r\n",
    b"content-length: 0\r\n", b"transfer-encoding: chunked\r\n", b"connection: close\r\n",
    b"connection: keep-alive\r\n", b"X-Up: v\r\n", b"\r\n", b"abc", b"3\r\nabc\r\n",
    b"0\r\n\r\n", b"ffffffff\r\n", b"\x00", b"\n", b" ", b":"])


@given(pieces=st.lists(st.one_of(_PIECES, st.binary(max_size=8)), max_size=24),
       cuts=st.lists(st.integers(0, 300), max_size=4), lost=st.booleans())
@SETTINGS
def test_fuzz_same_behaviour_as_the_reference(pieces: list[bytes], cuts: list[int],
                                              lost: bool) -> None:
    """Response-like garbage fed to both connection protocols over an in-memory transport,
    cut anywhere, a reader waiting on ``next_chunk``: the same status, headers, pieces,
    errors, transport calls and pool counters."""
    data = b"".join(pieces)
    results = [asyncio.run(_observe(impl, data, cuts, lost))[0]
               for impl in ("python", "compiled")]
    assert results[0] == results[1]


async def _observe(impl: str, data: bytes, cuts: list[int], lost: bool) -> tuple[list[Any], Any]:
    """``data`` fed to a fresh connection protocol of ``impl`` (in pieces cut at ``cuts``,
    then the connection lost when ``lost``), a reader waiting on ``next_chunk``: (what was
    observed: status, headers, pieces, errors, transport calls, pool counters; the
    connection)."""
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    pool = IMPLS[impl]("127.0.0.1", 1)
    conn = CONNS[impl](pool)
    t = _Transport()
    conn.connection_made(t)
    log: list[Any] = []
    resp: Any = None
    task: asyncio.Future[Any] | None = None

    async def settle() -> None:
        nonlocal task, resp
        for _ in range(3):
            await asyncio.sleep(0)
            if resp is None and conn.headers_done:
                resp = RESPS[impl](conn, None)
                log.append(("answer", resp.status, list(resp.headers)))
            if resp is not None and task is None:
                task = asyncio.ensure_future(resp.next_chunk())
            if task is not None and task.done():
                e = task.exception()
                log.append(("error", err(e)) if e else ("piece", task.result()))
                task = None
    for a, b in zip(bounds, bounds[1:]):
        conn.data_received(data[a:b])
        await settle()
    if lost:
        conn.connection_lost(None)
    await settle()
    if task is not None:
        task.cancel()
        await asyncio.sleep(0)
    if resp is not None:
        resp.close()
    log.append((t.calls, t.closing, pool.open_connections, pool.idle_connections))
    return log, conn


# -- the plain-response scanner (compiled only) ----------------------------------------------
# A whole answer in one read (HTTP/1.1, a final status but 204 / 304, token names, visible
# ASCII values, a Content-Length body, nothing after it) is taken without httptools; any
# other goes to httptools. Either way the observations must be the reference's.
OKH = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
PLAIN: dict[str, tuple[bytes, int]] = {
    "ok": (OKH + b"content-length: 3\r\n\r\nabc", 1),
    "no-reason": (b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nab", 1),
    "error-status": (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                     b"content-length: 2\r\n\r\n{}", 1),
    "empty-body": (OKH + b"content-length: 0\r\n\r\n", 1),
    "keep-alive": (OKH + b"Connection: keep-alive\r\ncontent-length: 1\r\n\r\na", 1),
    # declined: httptools decides
    "connection-close": (OKH + b"connection: close\r\ncontent-length: 1\r\n\r\na", 0),
    "http10": (b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\na", 0),
    "chunked": (OKH + b"transfer-encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", 1),
    "chunked-upper": (OKH + b"Transfer-Encoding: Chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", 1),
    "chunked-and-length": (OKH + b"transfer-encoding: chunked\r\ncontent-length: 6\r\n\r\n"
                           b"1\r\na\r\n0\r\n\r\n", 0),
    "chunked-gzip": (OKH + b"transfer-encoding: gzip, chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", 0),
    "close-delimited": (OKH + b"\r\nabc", 0),
    "no-content": (b"HTTP/1.1 204 No Content\r\ncontent-length: 3\r\n\r\n", 0),
    "not-modified": (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 3\r\n\r\n", 0),
    "interim-first": (b"HTTP/1.1 100 Continue\r\n\r\n" + OKH + b"content-length: 1\r\n\r\na", 0),
    "body-short": (OKH + b"content-length: 5\r\n\r\nabc", 0),
    "bytes-after": (OKH + b"content-length: 1\r\n\r\nab", 0),
    "cl-twice": (OKH + b"content-length: 1\r\ncontent-length: 1\r\n\r\na", 0),
    "trailing-ows": (OKH + b"x-a: v \r\ncontent-length: 1\r\n\r\na", 0),
    "obs-text-reason": (b"HTTP/1.1 200 \xc3\xa9\r\ncontent-length: 1\r\n\r\na", 0),
    "bad-status": (b"HTTP/1.1 2x0 OK\r\ncontent-length: 1\r\n\r\na", 0),
    "status-600": (b"HTTP/1.1 600 X\r\ncontent-length: 1\r\n\r\na", 0),
    "upgrade": (OKH + b"upgrade: h2c\r\ncontent-length: 1\r\n\r\na", 0),
}


@pytest.mark.parametrize("lost", [False, True])
@pytest.mark.parametrize("case", sorted(PLAIN))
def test_plain_scanner_same_observations_as_the_reference(case: str, lost: bool) -> None:
    """Each answer the scanner takes or declines is observed as the reference observes it,
    whole or cut in two, and the scanner takes exactly the answers it should."""
    data, plain = PLAIN[case]
    for cuts in ([], [len(data) // 2]):
        py, _ = asyncio.run(_observe("python", data, cuts, lost))
        c, conn = asyncio.run(_observe("compiled", data, cuts, lost))
        assert c == py
        # cut in two inside the head: httptools' (a chunked body may be cut anywhere)
        assert conn.plain_responses == (plain if not cuts or (
            b"chunked\r\n\r\n" in data[:cuts[0]]) else 0)
        if plain:
            assert py[0][:2] == ("answer", int(data[9:12]))


CH = OKH + b"transfer-encoding: chunked\r\n\r\n"
#: plain chunked bodies the decoder takes, and bodies it hands to httptools part-way
CHUNKED: dict[str, bytes] = {
    "events": CH + b"9\r\ndata: a\n\n\r\n" + b"1A\r\n" + b"x" * 26 + b"\r\n"
              b"00f\r\n" + b"y" * 15 + b"\r\n0\r\n\r\n",
    "one-chunk": CH + b"3\r\nabc\r\n0\r\n\r\n",
    "empty": CH + b"0\r\n\r\n",
    "extension": CH + b"3;x=1\r\nabc\r\n0\r\n\r\n",
    "bad-size": CH + b"3\r\nabc\r\nzz\r\n0\r\n\r\n",
    "size-space": CH + b"3 \r\nabc\r\n0\r\n\r\n",
    "size-8-digits": CH + b"00000003\r\nabc\r\n0\r\n\r\n",
    "size-huge": CH + b"fffffffffff\r\nabc",
    "size-lf": CH + b"3\nabc\r\n0\r\n\r\n",
    "no-crlf-after-data": CH + b"3\r\nabcd\r\n0\r\n\r\n",
    "cr-then-x": CH + b"3\r\nabc\rx0\r\n\r\n",
    "trailers": CH + b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n",
    "bytes-after-end": CH + b"3\r\nabc\r\n0\r\n\r\nGARBAGE",
    "answer-after-end": CH + b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nz",
    "cut-off": CH + b"5\r\nab",
}


@pytest.mark.parametrize("case", sorted(CHUNKED))
def test_plain_chunked_body_same_observations_as_the_reference(case: str) -> None:
    """A chunked body decoded without httptools (or handed to it part-way) gives the
    reference's observations whatever the reads: cut in two at every byte, and in three."""
    data = CHUNKED[case]
    head = len(CH)
    cutsets = [[k] for k in range(1, len(data))] + [[head + 1, head + 4], [head + 2, len(data) - 2]]
    for cuts in cutsets:
        for lost in (False, True):
            py, _ = asyncio.run(_observe("python", data, cuts, lost))
            c, conn = asyncio.run(_observe("compiled", data, cuts, lost))
            assert c == py, (cuts, lost)
            want = 1 if cuts[0] >= head else 0
            if case == "answer-after-end" and cuts[0] == head + 5:
                want = 2    # the first ended with its read: the pool's idle connection took
            assert conn.plain_responses == want, cuts    # the second as a new answer


def test_plain_chunked_body_is_decoded_here() -> None:
    """The decoder takes a whole plain chunked stream itself: its pieces, its end, and the
    connection kept for the next request."""
    async def go() -> None:
        log, conn = await _observe("compiled", CHUNKED["events"], [len(CH), len(CH) + 9], False)
        assert conn.plain_responses == 1 and conn.keep_alive
        assert log[-1][1] is False and log[-1][3] == 1      # not closed, back in the pool
        body = b"".join(x[1] for x in log if x[0] == "piece" and x[1] is not None)
        assert body == b"data: a\n\n" + b"x" * 26 + b"y" * 15
    asyncio.run(go())


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_evicted_while_connecting_ends_at_once(impl: str) -> None:
    """A request still connecting (the engine's accept queue full: its SYN unanswered) is
    ended by its owner's eviction at once, not after the connect timeout; nothing stays
    counted open."""
    import socket
    import time

    async def go() -> None:
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        port = lst.getsockname()[1]
        fillers = []
        for _ in range(4):          # fill the accept queue: later SYNs are dropped
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        await asyncio.sleep(0.05)
        pool = IMPLS[impl]("127.0.0.1", port, connect_timeout_s=10.0)
        a = object()
        try:
            t = asyncio.ensure_future(pool.request(b"GET", b"/", b"", owner=a))
            await asyncio.sleep(0.2)
            assert not t.done()             # still connecting
            t0 = time.monotonic()
            assert pool.evict(a, UpstreamEvicted("instance left")) == 1
            with pytest.raises(UpstreamEvicted, match="instance left"):
                await asyncio.wait_for(t, 2.0)
            assert time.monotonic() - t0 < 1.0
            assert pool.open_connections == 0 and pool.idle_connections == 0
            assert pool.evict(a, UpstreamEvicted("again")) == 0
        finally:
            pool.close()
            for s in fillers:
                s.close()
            lst.close()
    run_loop("uvloop", go)
