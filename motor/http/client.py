"""Pooled HTTP/1.1 client on asyncio (uvloop) + httptools.

One :class:`Pool` per upstream endpoint (host, port) keeps idle keep-alive
connections, checks them before reuse, caps how many are open, and opens new
ones with a connect timeout. :meth:`Pool.request` sends one request and returns
an :class:`UpstreamResponse` as soon as the status line and headers arrived; its
body is read chunk by chunk as the engine sends it (never buffered whole), with
an idle timeout between chunks. Closing a response before its end closes the
connection, which aborts the request in the engine.

Two implementations of :class:`Pool` (with its connection protocol and
:class:`UpstreamResponse`) behave the same: the classes below, the pure-Python reference,
and the compiled ones of :mod:`motor._fast.upstream` (Cython; fewer CPU instructions per
request). A :class:`Client` makes its pools with :data:`POOL`: the compiled class when
that extension is importable, the Python one when the environment variable
``MOTOR_PURE_HTTP=1`` is set at import (or the extension is not built); :data:`COMPILED`
says which. ``Pool(...)`` called directly is always the reference. Both raise the
exceptions defined here (:class:`UpstreamTimeout`, :class:`UpstreamClosed`).
"""
from __future__ import annotations

import asyncio
import os
import ssl
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import cast

import httptools

try:
    from motor._fast import upstream as _upstream
except ImportError:  # pragma: no cover - the extension is not built
    _upstream = None  # type: ignore[assignment]

Headers = Iterable[tuple[bytes, bytes]]

_HIGH_WATER = 1 << 20  # pause reading an upstream socket above 1 MiB of unread body


class UpstreamTimeout(asyncio.TimeoutError):
    """An upstream did not answer in time: ``phase`` is ``connect``, ``first_byte``,
    ``idle`` (between chunks) or ``pool`` (no free connection of the endpoint's pool within
    ``pool_wait_s``: the request never left)."""

    def __init__(self, phase: str, timeout_s: float) -> None:
        super().__init__(f"upstream {phase} timeout after {timeout_s:g} s")
        self.phase = phase
        self.timeout_s = timeout_s


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the answer was complete."""

    def __init__(self, msg: str, *, before_response: bool) -> None:
        super().__init__(msg)
        self.before_response = before_response


class UpstreamEvicted(Exception):
    """The request was taken off its endpoint before the answer's head came
    (:meth:`Pool.evict`: the endpoint left the routable set); ``reason`` says why. Raised
    only to a request made with an ``owner``; it may go to another endpoint."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _expire_wait(fut: asyncio.Future[None], wait_s: float) -> None:
    if not fut.done():
        fut.set_exception(UpstreamTimeout("pool", wait_s))


class _Conn(asyncio.Protocol):
    """One upstream connection; the protocol object is also the response's data source."""

    __slots__ = ("pool", "transport", "parser", "status", "headers", "chunks", "buffered",
                 "headers_done", "complete", "error", "waiter", "paused", "got_bytes", "closed",
                 "keep_alive", "timer", "counted_out", "interim", "owner", "evicted")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.counted_out = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.got_bytes = False
        self.keep_alive = True
        self.timer: asyncio.TimerHandle | None = None
        self.interim = False
        #: the ``owner`` of the request running here (:meth:`Pool.request`; None while
        #: idle: reset when handed back); ``evicted``: what :meth:`Pool.evict` raised into it
        self.owner: object = None
        self.evicted: UpstreamEvicted | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            # an upgrade (101) is never asked for: the bytes after it are no HTTP answer
            self.error = UpstreamClosed(f"malformed HTTP response from upstream: {e}",
                                        before_response=not self.headers_done)
            self.close()
            self._wake()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if not self.complete and self.error is None:
            if self.headers_done and not self.parser.should_keep_alive() \
                    and not self._has_length_or_chunked():
                # close-delimited body: the close is the end of the message
                self.complete = True
            else:
                self.error = UpstreamClosed(
                    "upstream closed the connection" + (f": {exc}" if exc else ""),
                    before_response=not self.got_bytes)
        self._wake()

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # an interim answer (100 Continue, 103 Early Hints): not the response, which
            # follows on the same connection; its headers are dropped (RFC 9110 section 15.2:
            # a client must accept an unexpected 1xx). A 101 stops the parser (an upgrade
            # this client never asks for): data_received answers it as malformed.
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        self.keep_alive = bool(self.parser.should_keep_alive())
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:        # the 1xx ended: wait for the final answer's head
            self.interim = False
            self.status = 0
            return
        self.complete = True
        self._wake()

    # helpers
    def _has_length_or_chunked(self) -> bool:
        for k, v in self.headers:
            if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
                return True
        return False

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_timeout(self, phase: str, timeout_s: float) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(UpstreamTimeout(phase, timeout_s))

    async def wait(self, timeout_s: float | None, phase: str) -> None:
        loop = asyncio.get_running_loop()
        self.waiter = w = loop.create_future()
        h = loop.call_later(timeout_s, self._on_timeout, phase, timeout_s) if timeout_s else None
        try:
            await w
        finally:
            self.waiter = None
            if h is not None:
                h.cancel()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()


class UpstreamResponse:
    """An engine's answer: status and headers now, body chunks as they come.

    Use as an async context manager or call :meth:`close` (idempotent); a response
    read to its end hands its connection back to the pool.
    """

    __slots__ = ("_conn", "status", "headers", "_idle_timeout_s", "_done")

    def __init__(self, conn: _Conn, idle_timeout_s: float | None) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._idle_timeout_s = idle_timeout_s
        self._done = False

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return default

    async def next_chunk(self) -> bytes | None:
        """Next piece of the (de-chunked) body, or ``None`` at its end.

        Raises
        ------
        UpstreamTimeout
            no byte for ``idle_timeout_s``.
        UpstreamClosed
            the connection ended before the body was complete.
        """
        c = self._conn
        while True:
            if c.chunks:
                if len(c.chunks) == 1:
                    data = c.chunks.popleft()
                else:
                    data = b"".join(c.chunks)
                    c.chunks.clear()
                c.buffered = 0
                if c.paused and c.transport is not None:
                    c.paused = False
                    c.transport.resume_reading()
                return data
            if c.complete:
                self._finish()
                return None
            if c.error is not None:
                self._finish()
                raise c.error
            await c.wait(self._idle_timeout_s, "idle")

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.next_chunk()
            if chunk is None:
                return
            yield chunk

    def read_now(self) -> bytes | None:
        """The whole body when all of it is here already (the answer complete, its
        connection handed back to the pool), else ``None`` and nothing changed: read it
        with :meth:`read` (no coroutine for an answer that came with its head)."""
        c = self._conn
        if self._done or not c.complete or c.error is not None or c.paused:
            return None
        data = b"".join(c.chunks)
        c.chunks.clear()
        c.buffered = 0
        self._finish()
        return data

    async def read(self) -> bytes:
        """The whole remaining body."""
        parts: list[bytes] = []
        while True:
            chunk = await self.next_chunk()
            if chunk is None:
                return b"".join(parts)
            parts.append(chunk)

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        c = self._conn
        if c.complete and c.error is None and c.keep_alive:
            c.pool._release(c)
        else:
            c.close()
            c.pool._drop(c)

    def close(self) -> None:
        """Stop reading; an unfinished answer closes (aborts) the upstream connection."""
        if self._done:
            return
        c = self._conn
        if not c.complete:
            c.close()
        self._finish()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Pool:
    """Keep-alive connections to one endpoint.

    Parameters
    ----------
    host, port : str, int
    max_connections : int
        Open connections at most (idle + busy); callers beyond it wait for one.
    connect_timeout_s : float
    tls : ssl.SSLContext or None
        HTTPS: connections are TLS with this client context (server name = ``host``).
    pool_wait_s : float or None
        Longest wait for a free connection when all ``max_connections`` are busy, then
        :class:`UpstreamTimeout` ``("pool", pool_wait_s)``; ``None`` = no bound.
    max_idle : int
        Idle keep-alive connections kept at most; one more released is closed (a burst
        does not leave thousands of engine connections open).
    """

    def __init__(self, host: str, port: int, max_connections: int = 1024,
                 connect_timeout_s: float = 5.0, tls: ssl.SSLContext | None = None,
                 pool_wait_s: float | None = None, max_idle: int = 1024) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.pool_wait_s = pool_wait_s
        self.max_idle = max_idle
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._idle: deque[_Conn] = deque()
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: every connection counted in (connecting, busy or idle): what :meth:`evict` scans
        self._conns: set[_Conn] = set()
        #: the pool waits of requests made with an owner: future -> [owner, the eviction's
        #: exception or None] (a wait already woken when evicted still ends so)
        self._evictable: dict[asyncio.Future[None], list[object]] = {}
        self._host_header = f"{host}:{port}".encode()
        self.closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def _connect(self, owner: object = None) -> _Conn:
        loop = asyncio.get_running_loop()
        conn = _Conn(self)
        conn.owner = owner
        self._conns.add(conn)
        try:
            made = asyncio.wait_for(
                loop.create_connection(lambda: conn, self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls else None),
                self.connect_timeout_s)
            if owner is None:
                await made
            else:
                await self._connect_evictable(conn, loop, made)
        except TimeoutError:
            self._conns.discard(conn)
            raise UpstreamTimeout("connect", self.connect_timeout_s) from None
        except BaseException:
            self._conns.discard(conn)
            raise
        return conn

    @staticmethod
    async def _connect_evictable(conn: _Conn, loop: asyncio.AbstractEventLoop,
                                 made: Awaitable[object]) -> None:
        """Wait for ``made`` (the connect) on ``conn``'s waiter, which :meth:`evict` fails:
        the connect runs in a task of its own, cancelled when the wait ends first; a
        connection made after that is closed."""
        w = conn.waiter = loop.create_future()
        t = asyncio.ensure_future(made)

        def done(t: asyncio.Future[object]) -> None:
            if t.cancelled():
                return
            e = t.exception()
            if not w.done():
                if e is None:
                    w.set_result(None)
                else:
                    w.set_exception(e)
            elif e is None:         # connected after the wait was given up
                conn.close()
        t.add_done_callback(done)
        try:
            await w
        except BaseException:
            if not t.done():
                t.cancel()
            raise
        finally:
            conn.waiter = None

    async def _acquire(self, owner: object = None) -> tuple[_Conn, bool]:
        while True:
            while self._idle:
                c = self._idle.pop()
                if c.reusable():
                    return c, True
                self._drop(c)
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await self._connect(owner), False
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._waiters.append(fut)
            entry: list[object] | None = None
            if owner is not None:
                entry = self._evictable[fut] = [owner, None]
            timer = loop.call_later(self.pool_wait_s, _expire_wait, fut, self.pool_wait_s) \
                if self.pool_wait_s is not None else None
            try:
                await fut
            finally:
                if timer is not None:
                    timer.cancel()
                if not fut.done():
                    fut.cancel()
                if entry is not None:
                    self._evictable.pop(fut, None)
            if entry is not None and isinstance(entry[1], BaseException):
                # evicted after it was woken for a connection: the next waiter takes that one
                self._wake_one()
                raise entry[1]

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _release(self, c: _Conn) -> None:
        if c.closed or self.closed:
            c.close()       # a closed pool keeps no connection open (an endpoint removed)
            self._drop(c)
            return
        if len(self._idle) >= self.max_idle and not self._waiters:
            c.close()       # enough idle ones: this one goes (counted out by _drop)
            self._drop(c)
            return
        c._reset()
        self._idle.append(c)
        self._wake_one()

    def _drop(self, c: _Conn) -> None:
        self._conns.discard(c)
        if c.counted_out:
            return
        c.counted_out = True
        self._open -= 1
        self._wake_one()

    def _forget(self, c: _Conn) -> None:
        """Called on connection_lost: an idle connection closed by the engine leaves the pool."""
        try:
            self._idle.remove(c)
        except ValueError:
            return
        self._drop(c)

    async def request(self, method: bytes, path: bytes, body: bytes = b"",
                      headers: Headers = (), *, first_byte_timeout_s: float | None = None,
                      idle_timeout_s: float | None = None,
                      owner: object = None) -> UpstreamResponse:
        """Send a request; return once status and headers arrived.

        A reused keep-alive connection that turns out to be closed before any byte of
        the answer arrived is retried once on a fresh connection (the request never
        reached the engine's application). ``owner`` (any object, compared by identity):
        :meth:`evict` of that owner ends the request with :class:`UpstreamEvicted` while
        its answer's head has not come (None: never evicted).

        Raises
        ------
        UpstreamTimeout
            connect or first byte too slow.
        UpstreamClosed, OSError
            connection refused / reset.
        UpstreamEvicted
            :meth:`evict` of ``owner`` before the answer's head came (its connection closed).
        """
        head = [method, b" ", path, b" HTTP/1.1\r\nhost: ", self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            head += [k, b": ", v, b"\r\n"]
        head.append(b"\r\n")
        head.append(body)
        data = b"".join(head)
        for attempt in (0, 1):
            conn, reused = await self._acquire(owner)
            conn.owner = owner
            try:
                assert conn.transport is not None
                conn.transport.write(data)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(first_byte_timeout_s, "first byte")
            except UpstreamClosed as e:
                conn.close()
                self._drop(conn)
                if reused and e.before_response and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                self._drop(conn)
                raise
            return UpstreamResponse(conn, idle_timeout_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def evict(self, owner: object, exc: UpstreamEvicted) -> int:
        """End the requests made with ``owner`` (:meth:`request`) whose answer's head has
        not come: ``exc`` is raised in each (their connections close), in those waiting for
        a pooled connection (even one woken for a connection but not resumed yet) and those
        connecting (the connect abandoned) too. Streams already answering go on. Returns
        how many were ended (0 for owner ``None``: requests without one are never
        evicted)."""
        n = 0
        if owner is None:
            return 0
        for c in list(self._conns):
            if c.owner is owner and not c.headers_done and c.evicted is None:
                c.evicted = exc
                n += 1
                w = c.waiter
                if w is not None and not w.done():
                    w.set_exception(exc)
        for fut, entry in list(self._evictable.items()):
            if entry[0] is owner and entry[1] is None:
                entry[1] = exc
                if not fut.done():
                    fut.set_exception(exc)
                n += 1
        return n

    def close(self) -> None:
        self.closed = True
        while self._idle:
            c = self._idle.pop()
            c.close()
            self._open -= 1
        for w in self._waiters:
            if not w.done():
                w.set_exception(ConnectionError("pool closed"))
        self._waiters.clear()


if _upstream is not None:
    _upstream.bind(UpstreamTimeout, UpstreamClosed)

#: the pool class of the compiled implementation (None: not built)
COMPILED_POOL: type[Pool] | None = \
    cast("type[Pool]", _upstream.Pool) if _upstream is not None else None
#: True when new :class:`Client` objects make compiled pools
COMPILED = COMPILED_POOL is not None and os.environ.get("MOTOR_PURE_HTTP", "") != "1"
#: the pool class new :class:`Client` objects use (``Pool(host, port, ...)``)
POOL: type[Pool] = COMPILED_POOL if COMPILED and COMPILED_POOL is not None else Pool


class Client:
    """Pools by (host, port), created on first use. ``tls``: the client context of the
    endpoints marked HTTPS with :meth:`use_tls` (the others stay plain HTTP);
    ``pool_wait_s`` and ``max_idle_per_endpoint``: see :class:`Pool`."""

    def __init__(self, max_connections_per_endpoint: int = 1024,
                 connect_timeout_s: float = 5.0, tls: ssl.SSLContext | None = None,
                 pool_wait_s: float | None = None, max_idle_per_endpoint: int = 1024) -> None:
        self._pools: dict[tuple[str, int], Pool] = {}
        self.max_connections = max_connections_per_endpoint
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.pool_wait_s = pool_wait_s
        self.max_idle = max_idle_per_endpoint
        self._tls_endpoints: set[tuple[str, int]] = set()
        #: ``pool(host, port, ...)`` for every endpoint (:data:`POOL` at creation)
        self.pool_class: type[Pool] = POOL

    def use_tls(self, host: str, port: int, on: bool = True) -> None:
        """Speak HTTPS to ``host:port`` (``on=False``: plain HTTP again). Call it before the
        pool is first used; a pool already open with the other scheme is closed (an engine
        restarted with or without TLS on the same port).

        Raises
        ------
        ValueError
            HTTPS asked of a client without a TLS context.
        """
        key = (host, port)
        if on == (key in self._tls_endpoints):
            return
        if on:
            if self.tls is None:
                raise ValueError(f"HTTPS to {host}:{port} needs a TLS client context")
            self._tls_endpoints.add(key)
        else:
            self._tls_endpoints.discard(key)
        self.discard(host, port)

    def speaks_tls(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is reached over HTTPS (:meth:`use_tls`)."""
        return (host, port) in self._tls_endpoints

    def pool(self, host: str, port: int) -> Pool:
        key = (host, port)
        p = self._pools.get(key)
        if p is None:
            p = self._pools[key] = self.pool_class(
                host, port, self.max_connections, self.connect_timeout_s,
                self.tls if key in self._tls_endpoints else None, self.pool_wait_s,
                self.max_idle)
        return p

    def discard(self, host: str, port: int) -> None:
        p = self._pools.pop((host, port), None)
        if p is not None:
            p.close()

    async def get_json_bytes(self, host: str, port: int, path: str, timeout_s: float) -> tuple[int, bytes]:
        """GET a small document; returns (status, body). For health checks and control traffic."""
        # asyncio.timeout, not wait_for: no inner task whose exception could go unretrieved
        # when the caller is cancelled as the request fails
        async with asyncio.timeout(timeout_s):
            resp = await self.pool(host, port).request(b"GET", path.encode(),
                                                       first_byte_timeout_s=timeout_s,
                                                       idle_timeout_s=timeout_s)
            async with resp:
                return resp.status, await resp.read()

    async def post_json_bytes(self, host: str, port: int, path: str, body: bytes,
                              timeout_s: float) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout_s):
            resp = await self.pool(host, port).request(
                b"POST", path.encode(), body, ((b"content-type", b"application/json"),),
                first_byte_timeout_s=timeout_s, idle_timeout_s=timeout_s)
            async with resp:
                return resp.status, await resp.read()

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
