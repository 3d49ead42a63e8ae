"""Minimal HTTP/1.1 server on asyncio (uvloop) + httptools.

Used by every motor process. It parses requests with ``httptools``, keeps
connections alive, supports pipelined requests (answered in order), bounds the
request body, and lets a handler answer either at once (:meth:`Response.send`)
or as a chunked stream (:meth:`Response.start` / :meth:`Response.write` /
:meth:`Response.end`) with write back-pressure (:meth:`Response.drain`).

A handler is ``async def handler(request: Request, response: Response) -> None``.
When the client goes away, the handler's task is cancelled, so whatever it awaits
(an upstream request, typically) is torn down at once.

Two implementations of the connection protocol and of :class:`Request` / :class:`Response`
behave the same: the classes below, the pure-Python reference, and the compiled ones of
:mod:`motor._fast.http1` (Cython; fewer CPU instructions per request). An
:class:`HttpServer` uses :data:`PROTOCOL`: the compiled protocol when that extension is
importable, the Python one when the environment variable ``MOTOR_PURE_HTTP=1`` is set at
import (or the extension is not built). Handlers get the :class:`Request` / :class:`Response`
of the implementation in use; :data:`COMPILED` says which.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable
from http import HTTPStatus
from urllib.parse import parse_qs

import httptools

from motor.protocol.openai import error_body

try:
    from motor._fast import http1 as _http1
except ImportError:  # pragma: no cover - the extension is not built
    _http1 = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

Handler = Callable[["Request", "Response"], Awaitable[object]]


class _Answered:
    """An awaitable that is already done: what a handler returns when it answered without
    awaiting anything (a 400, a 404): no coroutine made for it."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield       # a generator that ends at once: ``await ANSWERED`` is None


#: the done awaitable (:class:`_Answered`)
ANSWERED = _Answered()
Headers = Iterable[tuple[bytes, bytes]]

_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
        _STATUS_LINES[status] = line
    return line


_LINGER_RESET = struct.pack("ii", 1, 0)
#: seconds a refused client's further bytes are read and dropped before the close
LINGER_S = 2.0
#: HttpProtocol._deferred: close once the answers before are sent, with no answer of its own
_CLOSE: tuple[()] = ()


def reset(transport: asyncio.BaseTransport) -> None:
    """Make the next close of ``transport``'s socket a reset (``SO_LINGER`` 0): the kernel
    drops what is still queued for a peer that stopped reading, instead of holding it and
    the connection in FIN-WAIT-1 until the peer reads or its timers expire."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass


def bind_error_reason(e: OSError) -> str:
    """``address already in use`` for EADDRINUSE, ... (the OS's text, lower case)."""
    if isinstance(e.errno, int) and e.errno > 0:
        try:
            return os.strerror(e.errno).lower()
        except ValueError:
            pass
    return str(e) or type(e).__name__


def origin_form(method: bytes, target: bytes) -> bytes | None:
    """The path and query of a request target that is not origin-form (``/path?query``), as
    RFC 9112 section 3.2 reads it: absolute-form ``http://host[:port]/path?query`` (``http``
    or ``https``, any case; a proxy sends it) -> ``/path?query`` (``/`` when the path is
    empty); asterisk-form ``*`` -> ``*`` with ``OPTIONS`` only. ``None`` for anything else
    (another scheme, no host, userinfo in the authority, which RFC 9110 section 4.2.4 says to
    treat as an error, ``*`` with another method): a 400."""
    if target == b"*":
        return target if method == b"OPTIONS" else None
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    end = len(rest)
    for c in (b"/", b"?"):
        i = rest.find(c)
        if 0 <= i < end:
            end = i
    authority, path = rest[:end], rest[end:]
    if not authority or b"@" in authority:
        return None
    if not path.startswith(b"/"):
        path = b"/" + path
    return path


class ListenError(OSError):
    """A process could not listen on ``host:port``.

    Attributes: ``flag`` (the option or config field that set the address, or None),
    ``bad_host`` (the host did not resolve; else the port is the problem: in use, no
    permission...), ``reason`` (:func:`bind_error_reason`), ``message`` (one line for users).
    """

    def __init__(self, host: str, port: int, error: OSError, flag: str | None = None) -> None:
        self.host = host
        self.port = port
        self.flag = flag
        self.bad_host = isinstance(error, socket.gaierror)
        self.reason = bind_error_reason(error)
        where = f" ({flag})" if flag else ""
        self.message = f"cannot listen on {host}:{port}{where}: {self.reason}"
        super().__init__(error.errno, self.message)


class Request:
    """One parsed HTTP request.

    Attributes
    ----------
    method : bytes
        e.g. ``b"POST"``.
    path : str
        The path without the query string.
    query : str
        The raw query string (may be empty).
    headers : list[tuple[bytes, bytes]]
        In arrival order, names lower-cased.
    body : bytes
        The whole body (bounded by the server's ``max_body_bytes``).
    """

    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "peer", "http10")

    def __init__(self, method: bytes, path: str, query: str, headers: list[tuple[bytes, bytes]],
                 body: bytes, keep_alive: bool, peer: object, http10: bool = False) -> None:
        self.http10 = http10
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.peer = peer

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """First value of header ``name`` (lower-case bytes), or ``default``."""
        for k, v in self.headers:
            if k == name:
                return v
        return default

    def query_params(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(self.query).items()}


class Response:
    """The answer to one request; exactly one of ``send`` or ``start``..``end`` is used."""

    __slots__ = ("_proto", "started", "finished", "status", "_chunked", "keep_alive", "http10",
                 "head", "tap", "extra_headers", "_corked")

    def __init__(self, proto: HttpProtocol, keep_alive: bool, http10: bool = False) -> None:
        self._proto = proto
        self.http10 = http10
        self.head = False
        self.started = False
        self.finished = False
        self.status = 0
        self._chunked = False
        self.keep_alive = keep_alive
        #: called with every body byte string sent (``send``, ``write``, ``end``); None = none.
        #: The gateway's edge sets it to read the answer's usage for token rate limits
        self.tap: Callable[[bytes], None] | None = None
        #: headers added to whatever answer is sent (the edge's ``x-ratelimit-*``)
        self.extra_headers: Headers = ()
        #: what a corked answer holds back (:meth:`cork`); None: every piece written at once
        self._corked: list[bytes] | None = None

    @property
    def client_gone(self) -> bool:
        return self._proto.closed

    def cork(self) -> None:
        """Hold back what :meth:`start` and :meth:`write` send until :meth:`flush` or
        :meth:`end`, which write it in one piece (one system call where there were several:
        a stream's head with its first events, its last events with its end). The caller
        flushes before it waits for anything."""
        if self._corked is None:
            self._corked = []

    def flush(self) -> None:
        """Write what a corked answer holds back (it stays corked)."""
        if self._corked:
            data = b"".join(self._corked)
            self._corked = []
            self._proto.write(data)

    def _out(self, data: bytes) -> None:
        if self._corked is not None:
            self._corked.append(data)
        else:
            self._proto.write(data)

    def send(self, status: int, body: bytes = b"", content_type: bytes = b"application/json",
             headers: Headers = ()) -> None:
        """Send a complete response with ``Content-Length``."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        parts = [status_line(status), b"content-type: ", content_type,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            parts += [k, b": ", v, b"\r\n"]
        if self.extra_headers:
            for k, v in self.extra_headers:
                parts += [k, b": ", v, b"\r\n"]
        if self.keep_alive and self._proto._server.draining:
            self.keep_alive = False     # shutting down: say the connection goes with this answer
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if not self.head:
            parts.append(body)
        self._proto.write(b"".join(parts))
        if self.tap is not None:
            self.tap(body)
        self._proto.response_done(self)

    def start(self, status: int, content_type: bytes = b"text/event-stream",
              headers: Headers = ()) -> None:
        """Start a chunked response; follow with :meth:`write` calls and one :meth:`end`."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.http10 or self.head:
            # an HTTP/1.0 client knows no chunked encoding: the body ends when we close
            self._chunked = False
            self.keep_alive = False
            parts = [status_line(status), b"content-type: ", content_type, b"\r\n"]
        else:
            self._chunked = True
            parts = [status_line(status), b"content-type: ", content_type,
                     b"\r\ntransfer-encoding: chunked\r\n"]
        if content_type == b"text/event-stream":
            parts.append(b"cache-control: no-cache\r\n")
        for k, v in headers:
            parts += [k, b": ", v, b"\r\n"]
        if self.extra_headers:
            for k, v in self.extra_headers:
                parts += [k, b": ", v, b"\r\n"]
        if self.keep_alive and self._proto._server.draining:
            self.keep_alive = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._out(b"".join(parts))

    def write(self, data: bytes) -> None:
        """Send one chunk at once (held back while corked). Empty data is ignored."""
        if data and not self.head:
            if self._chunked:
                self._out(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                self._out(data)
            if self.tap is not None:
                self.tap(data)

    async def drain(self) -> None:
        """Wait while the client's socket buffer is full."""
        await self._proto.drain()

    def end(self, data: bytes = b"") -> None:
        """Finish a chunked response, optionally with a last chunk."""
        if self.finished:
            return
        self.finished = True
        if data and self.tap is not None:
            self.tap(data)
        if not self._chunked:
            if data and not self.head:
                self._out(data)
        elif data:
            self._out(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
        else:
            self._out(b"0\r\n\r\n")
        self.flush()
        self._corked = None
        self._proto.response_done(self)

    def abort(self) -> None:
        """Close the client connection (used when a started stream cannot be ended cleanly);
        what a corked answer held back is dropped."""
        self.finished = True
        self._corked = None
        self._proto.close()


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    __slots__ = ("_server", "_transport", "_parser", "_url", "_headers", "_body", "_body_len",
                 "_queue", "_task", "closed", "_paused", "_drain_waiter", "_peer", "_rejected",
                 "deadline", "_reading", "send_deadline",
                 "_current", "_head_len", "_deferred")

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._current: Response | None = None
        self.closed = False
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._peer: object = None
        self._rejected = False
        #: bytes of the request head read so far (target + header names and values)
        self._head_len = 0
        #: a refusal waiting for the answers of the requests before it (pipelining)
        self._deferred: tuple[int, str | bytes, Headers] | tuple[()] | None = None
        #: loop time after which the server's sweeper closes this connection (0 = none):
        #: reading one request (headers + body) or waiting idle for the next one
        self.deadline = 0.0
        self._reading = False
        #: loop time after which a client that stopped reading is cut (0 = not stalled)
        self.send_deadline = 0.0

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._server.connections.add(self)
        self.deadline = self._server.loop_time() + self._server.keepalive_timeout_s

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._task is not None:
                # the request asking for it is answered as plain HTTP/1.1 (a server may ignore
                # Upgrade, RFC 9110 section 7.8); what follows it is no HTTP/1.1: the
                # connection closes after the answers
                self._rejected = True
                if self._deferred is None:
                    self._deferred = _CLOSE
            else:
                self._reject(400, "protocol upgrade is not supported")
        except httptools.HttpParserError as e:
            self._reject(400, f"malformed HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client closed the connection"))
        self._queue.clear()

    def pause_writing(self) -> None:
        self._paused = True
        t = self._server.send_timeout_s
        if t:
            self.send_deadline = self._server.loop_time() + t

    def resume_writing(self) -> None:
        self._paused = False
        self.send_deadline = 0.0
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks ------------------------------------------------
    def on_message_begin(self) -> None:
        self.deadline = self._server.loop_time() + self._server.request_read_timeout_s
        self._reading = True
        self._url = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._head_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count_head(len(name) + len(value))

    def _count_head(self, n: int) -> None:
        self._head_len += n
        limit = self._server.max_header_bytes
        if self._head_len > limit and not self._rejected:
            self._reject(431, f"request header fields are larger than the limit of {limit} "
                              "bytes")

    def on_headers_complete(self) -> None:
        expect = None
        for k, v in self._headers:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > self._server.max_body_bytes:
                    # a final status before the body, also with Expect (RFC 9110 10.1.1)
                    self._reject(413, f"request body of {n} bytes is larger than the limit of "
                                      f"{self._server.max_body_bytes} bytes")
                    return
            elif k == b"expect":
                expect = v
        if expect is not None:
            self._expect(expect)

    def _expect(self, value: bytes) -> None:
        """``Expect: 100-continue`` (RFC 9110 section 10.1.1): tell the client to send the
        body now (curl waits 1 s for it on every large upload otherwise); any other
        expectation: 417. The interim answer is written only when no earlier response of a
        pipelined request is still being sent on this connection (the client then sends its
        body after its own wait)."""
        if value.strip().lower() != b"100-continue":
            self._reject(417, f"expectation {value[:100].decode('latin-1')!r} is not "
                              "supported: expected 100-continue")
            return
        check = self._server.expect_check
        if check is not None:
            # a final answer the headers already decide (401, 429) goes instead of the 100,
            # so a refused client does not upload its body first
            final = check(self._url, self._headers)
            if final is not None:
                self._reject(*final)
                return
        if self._parser.get_http_version() != "1.0" and self._task is None \
                and self._transport is not None and not self.closed:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_len += len(body)
        if self._body_len > self._server.max_body_bytes:
            self._reject(413, f"request body is larger than the limit of "
                              f"{self._server.max_body_bytes} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        self.deadline = 0.0  # a handler runs: no read deadline until it answered
        self._reading = False
        url = self._url
        if not url or url[0] != 47:     # not b"/": cheaper than startswith on every request
            # not origin-form (RFC 9112 section 3.2): absolute-form is reduced to its path
            # and query, ``*`` stays for OPTIONS, anything else is a 400
            target = origin_form(self._parser.get_method(), url)
            if target is None:
                self._reject(400, f"malformed request target {url[:200].decode('latin-1')!r}: "
                                  "expected /path, http(s)://host/path, or * with OPTIONS")
                return
            url = target
        q = url.find(b"?")
        if q >= 0:
            path, query = url[:q].decode("latin-1"), url[q + 1:].decode("latin-1")
        else:
            path, query = url.decode("latin-1"), ""
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(self._parser.get_method(), path, query, self._headers, body,
                      self._parser.should_keep_alive(), self._peer,
                      self._parser.get_http_version() == "1.0")
        if self._task is None:
            self._start(req)
        elif len(self._queue) >= 64:
            self._reject(429, "too many pipelined requests")
        else:
            self._queue.append(req)

    # -- internals ----------------------------------------------------------
    def _start(self, req: Request) -> None:
        if self._server.draining:
            # shutting down: a request that arrives now (kept-alive or pipelined connection)
            # is answered 503 at once, never started and cut at the drain deadline (case N10)
            resp = Response(self, False, req.http10)
            self._current = resp
            resp.send(503, error_body(503, "the server is shutting down; retry elsewhere"))
            return
        resp = Response(self, req.keep_alive, req.http10)
        self._current = resp
        self._task = asyncio.ensure_future(self._run(req, resp))

    async def _run(self, req: Request, resp: Response) -> None:
        # counted inside the coroutine: a task cancelled before its first step (the client left
        # in the same loop tick) never runs its finally, so it must not have counted either
        self._server.inflight += 1
        try:
            await self._server.handler(req, resp)
        except asyncio.CancelledError:
            if not resp.finished and not self.closed:
                self.close()
            raise
        except Exception:
            logger.exception("handler failed for %s %s", req.method.decode(), req.path)
            if not resp.started and not self.closed:
                resp.send(500, error_body(500, "internal error in motor"))
            elif not resp.finished:
                resp.abort()
            handler_failed(self._server, req)
        finally:
            self._server.inflight -= 1
            if not resp.finished and not self.closed:
                # a handler that returned without answering: never leave the client hanging
                if not resp.started:
                    resp.send(500, error_body(500, "no response produced"))
                else:
                    resp.abort()

    def response_done(self, resp: Response) -> None:
        self._task = None
        self._current = None
        if not resp.keep_alive or self._server.draining:
            self.close()      # draining: the connection goes with its last answer
            return
        if self._queue and not self.closed:
            self._start(self._queue.popleft())
        elif self._deferred is not None:
            # the requests before a refused one are answered: now its answer, and the close
            d, self._deferred = self._deferred, None
            if d is _CLOSE:
                self.close()
            else:
                self._reject(*d)
        else:
            self.deadline = self._server.loop_time() + self._server.keepalive_timeout_s

    def _reject(self, status: int, message: str | bytes, headers: Headers = ()) -> None:
        """Answer an unparsable / oversized / refused request and close the connection;
        ``message``: text for an OpenAI error body, or the whole JSON body as bytes."""
        self._rejected = True
        if self._transport is None or self.closed:
            return
        if self._task is not None:
            # pipelined after requests still being answered: their answers go first
            # (response_done), then this one, and the connection closes
            if self._deferred is None:
                self._deferred = (status, message, headers)
            return
        body = message if isinstance(message, bytes) else error_body(status, message)
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        self._transport.write(status_line(status) + b"content-type: application/json\r\n"
                              b"content-length: " + str(len(body)).encode() +
                              b"\r\n" + extra + b"connection: close\r\n\r\n" + body)
        self._linger()

    def _linger(self) -> None:
        """The end of a connection after a refusal: the write side is shut once the answer
        is out (the client reads it, then the end) while what the client still sends (the
        rest of an upload it was not asked for) is read and dropped for up to
        :data:`LINGER_S`: closed at once, its unread bytes would make the kernel reset the
        connection, and a reset can destroy the answer before the client reads it (RFC 9112
        section 9.6). A TLS connection cannot half-close: closed at once."""
        t = self._transport
        try:
            if t is not None and t.can_write_eof():
                t.write_eof()
                self.closed = True
                self._reading = False
                self.deadline = self._server.loop_time() + LINGER_S   # then timed_out closes
                return
        except (NotImplementedError, OSError, RuntimeError):
            pass                # a transport that cannot say, or that failed: close it
        self.close()

    def timed_out(self) -> None:
        """Called by the sweeper when :attr:`deadline` passed."""
        self.deadline = 0.0
        if self._reading:
            self._reject(408, f"request not received in full within "
                              f"{self._server.request_read_timeout_s:g} s")
        else:
            self.close()

    def send_timed_out(self) -> None:
        """Called by the sweeper: the client read nothing for ``send_timeout_s`` while answers
        waited in its socket buffer. The connection is aborted (a close would wait for the
        buffer to drain, which never happens); the handler is cancelled with it, which ends
        the upstream request."""
        self.send_deadline = 0.0
        logger.info("client %s stopped reading for %g s: connection closed", self._peer,
                    self._server.send_timeout_s)
        if self._transport is not None:
            reset(self._transport)
            self._transport.abort()

    def write(self, data: bytes) -> None:
        if not self.closed and self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client closed the connection")
        if not self._paused:
            return
        loop = asyncio.get_running_loop()
        self._drain_waiter = loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
        self.closed = True

    def idle(self) -> bool:
        return self._task is None and not self._queue


if _http1 is not None:
    _http1.bind(_STATUS_LINES, status_line, origin_form, error_body, logger, reset)

#: the connection protocol class of the compiled implementation (None: not built)
COMPILED_PROTOCOL: type[asyncio.Protocol] | None = \
    _http1.HttpProtocol if _http1 is not None else None
#: True when new :class:`HttpServer` objects use the compiled protocol
COMPILED = COMPILED_PROTOCOL is not None and os.environ.get("MOTOR_PURE_HTTP", "") != "1"
#: the protocol class new :class:`HttpServer` objects use (``HttpProtocol(server)``)
PROTOCOL: type[asyncio.Protocol] = COMPILED_PROTOCOL if COMPILED and COMPILED_PROTOCOL \
    is not None else HttpProtocol


def handler_failed(server: HttpServer, req: Request) -> None:
    """Tell ``server.on_handler_error`` (when set) that ``req``'s handler raised; what that
    callback raises is logged, not raised."""
    cb = server.on_handler_error
    if cb is not None:
        try:
            cb(req)
        except Exception:
            logger.exception("on_handler_error failed for %s", req.path)


class HttpServer:
    """An HTTP/1.1 server around one handler.

    Parameters
    ----------
    handler : async callable ``(Request, Response) -> None``
    max_body_bytes : int
        Larger request bodies get 413 with an OpenAI error body.
    max_header_bytes : int
        Larger request heads (target and header names and values, bytes) get 431.
    """

    def __init__(self, handler: Handler, max_body_bytes: int = 64 * 1024 * 1024,
                 request_read_timeout_s: float = 30.0, keepalive_timeout_s: float = 75.0,
                 send_timeout_s: float = 0.0, max_header_bytes: int = 64 * 1024) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        #: a request head (target + header names and values) above this gets 431
        self.max_header_bytes = max_header_bytes
        self.request_read_timeout_s = request_read_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        #: a client whose socket stays full this long is cut (0 = never)
        self.send_timeout_s = send_timeout_s
        #: ``(target, headers) -> (status, JSON body, headers) | None``: asked when a request
        #: carries ``Expect: 100-continue``; an answer is sent instead of the 100 (the
        #: gateway refuses a missing API key or an exhausted rate limit before the upload)
        self.expect_check: Callable[[bytes, list[tuple[bytes, bytes]]],
                                    tuple[int, bytes, Headers] | None] | None = None
        #: ``(request)``: a handler raised, and the server answered 500 (or cut an answer
        #: already started); the coordinator counts it in its requests metric
        self.on_handler_error: Callable[[Request], object] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.loop_time = time.monotonic
        #: ``protocol(server)`` for every accepted connection (:data:`PROTOCOL` at creation)
        self.protocol: Callable[[HttpServer], asyncio.Protocol] = PROTOCOL
        self.connections: set[HttpProtocol] = set()
        self.inflight = 0
        self.draining = False
        self._servers: list[asyncio.AbstractServer] = []

    async def listen(self, host: str, port: int, *, reuse_port: bool = False,
                     sock: socket.socket | None = None, backlog: int = 2048,
                     tls: ssl.SSLContext | None = None) -> int:
        """Start listening; returns the bound port (useful with ``port=0``). ``tls``: serve
        HTTPS with that server context (:func:`motor.http.tls.server_context`); the handshake
        must finish within ``request_read_timeout_s``."""
        loop = asyncio.get_running_loop()
        hs = self.request_read_timeout_s if tls is not None else None
        if sock is not None:
            srv = await loop.create_server(lambda: self.protocol(self), sock=sock, backlog=backlog,
                                           ssl=tls, ssl_handshake_timeout=hs)
        else:
            srv = await loop.create_server(lambda: self.protocol(self), host, port,
                                           reuse_address=True, reuse_port=reuse_port or None,
                                           backlog=backlog, ssl=tls, ssl_handshake_timeout=hs)
        self._servers.append(srv)
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())
        return int(srv.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        """Close connections past their deadline: a request whose headers and body did not arrive
        within ``request_read_timeout_s`` gets 408; an idle keep-alive connection silent for
        ``keepalive_timeout_s`` is closed (slow or abandoned clients never hold sockets forever)."""
        step = min(1.0, self.request_read_timeout_s / 4, self.keepalive_timeout_s / 4,
                   (self.send_timeout_s or 4.0) / 4)
        while True:
            await asyncio.sleep(step)
            now = self.loop_time()
            for c in list(self.connections):
                if c.deadline and now > c.deadline:
                    c.timed_out()
                if c.send_deadline and now > c.send_deadline:
                    c.send_timed_out()

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, wait up to ``drain_timeout_s`` for in-flight requests, close the rest."""
        self.draining = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for s in self._servers:
            s.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        for c in list(self.connections):
            if c.idle():
                c.close()
        while self.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c.close()
        for s in self._servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except (TimeoutError, Exception):
                pass


class Router:
    """Exact-path routing table: ``(method, path) -> handler``; 404 / 405 with OpenAI bodies.

    :meth:`add_prefix` adds a route for every path under a prefix (``/v1/models/`` + a model
    id that may hold ``/``), looked up only when no exact path matches (an exact route costs
    one dict lookup whatever the prefixes). ``OPTIONS *`` is answered 200 with the methods
    served (``allow``)."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[bytes, Handler]] = {}
        self._prefixes: list[tuple[str, dict[bytes, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path, {})[method.encode()] = handler

    def add_prefix(self, method: str, prefix: str, handler: Handler) -> None:
        """Route ``method`` on every path that starts with ``prefix`` and is longer (the
        handler reads the rest of ``req.path``); longest prefix first."""
        for p, by_method in self._prefixes:
            if p == prefix:
                by_method[method.encode()] = handler
                return
        self._prefixes.append((prefix, {method.encode(): handler}))
        self._prefixes.sort(key=lambda e: -len(e[0]))

    def _by_prefix(self, path: str) -> dict[bytes, Handler] | None:
        for p, by_method in self._prefixes:
            if len(path) > len(p) and path.startswith(p):
                return by_method
        return None

    def get(self, path: str) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.add("GET", path, fn)
            return fn
        return deco

    def post(self, path: str) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.add("POST", path, fn)
            return fn
        return deco

    def __call__(self, req: Request, resp: Response) -> Awaitable[object]:
        """Answer ``req``: returns what to await, the route's handler's own awaitable (no
        coroutine layer of the router's on the hot path), or :data:`ANSWERED`."""
        by_method = self._routes.get(req.path)
        if by_method is None:
            by_method = self._by_prefix(req.path) if self._prefixes else None
            if by_method is None:
                if req.path == "*":     # OPTIONS * (origin_form lets no other method through)
                    methods = {m for r in self._routes.values() for m in r}
                    if b"GET" in methods:
                        methods.add(b"HEAD")
                    resp.send(200, headers=((b"allow", b", ".join(sorted(methods))),))
                    return ANSWERED
                resp.send(404, error_body(404, f"no route for {req.path}"))
                return ANSWERED
        h = by_method.get(req.method)
        if h is None:
            if req.method == b"HEAD" and b"GET" in by_method:
                h = by_method[b"GET"]
                resp.head = True  # the GET answer's status and headers, no body
            else:
                allowed = ", ".join(sorted(m.decode() for m in by_method))
                resp.send(405, error_body(405, f"method {req.method.decode()} not allowed on "
                                               f"{req.path} (allowed: {allowed})"))
                return ANSWERED
        return h(req, resp)


def install_uvloop() -> None:
    """Use uvloop's event loop policy when available (it is a declared dependency)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
