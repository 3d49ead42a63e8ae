# cython: language_level=3
"""The HTTP/1.1 server protocol of :mod:`motor.http.server`, compiled.

:class:`HttpProtocol`, :class:`Request` and :class:`Response` behave exactly as the
pure-Python classes of the same names in ``motor/http/server.py`` (the reference: the same
bytes on the wire, the same attributes and methods, the same errors); the server tests run
against both. What differs is the cost per request: typed attributes read as C struct
fields, the ``httptools`` callbacks and the response framing are C calls, the handler
coroutine is a Cython coroutine, the request object is built without argument parsing.

The parser is ``httptools.HttpRequestParser`` called through its Python interface (the
same parser, the same errors as the reference). This module imports nothing from
``motor``: ``motor.http.server`` hands it, once, with :func:`bind`, what the answers
need from there (the status line cache, the request-target reduction, the OpenAI error
body, the logger of handler failures).

Public interface (see the stub ``http1.pyi``): ``Request(method, path, query, headers,
body, keep_alive, peer, http10=False)`` with ``header(name, default=None)`` and
``query_params()``; ``Response`` with ``send``, ``start``, ``write``, ``drain``, ``end``,
``abort`` and ``client_gone``; ``HttpProtocol(server)``, an ``asyncio.Protocol`` (duck
typed: a cdef class cannot derive from ``asyncio.Protocol``).
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeLatin1
from libc.string cimport memchr, memcmp, memcpy

from motor._fast._common cimport mf_join

from motor._fast.httpscan cimport (hs_header_line, hs_is_keep_alive, hs_length,
                                    hs_lower_name, hs_pchar)

import asyncio
import socket
from collections import deque
from urllib.parse import parse_qs

import httptools

cdef object _HttpRequestParser = httptools.HttpRequestParser
cdef object _HttpParserUpgrade = httptools.HttpParserUpgrade
cdef object _HttpParserError = httptools.HttpParserError
cdef object _CancelledError = asyncio.CancelledError
cdef object _get_running_loop = asyncio.get_running_loop
cdef object _deque = deque
cdef object _parse_qs = parse_qs
cdef object _AF_INETS = (socket.AF_INET, socket.AF_INET6)
cdef object _IPPROTO_TCP = socket.IPPROTO_TCP
cdef object _TCP_NODELAY = socket.TCP_NODELAY

# bound once by motor.http.server (bind)
cdef dict _status_lines = None
cdef object _status_line = None
cdef object _origin_form = None
cdef object _error_body = None
cdef object _logger = None
cdef object _reset_socket = None

cdef bytes _CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
cdef bytes _LAST_CHUNK = b"0\r\n\r\n"
cdef bytes _EMPTY = b""
cdef str _HTTP10 = "1.0"
cdef double _LINGER_S = 2.0    # motor.http.server.LINGER_S
cdef tuple _CLOSE = ()         # HttpProtocol._deferred: close after the answers, no answer


def bind(dict status_lines not None, status_line, origin_form, error_body, logger,
         reset=None):
    """Give the compiled protocol what it takes from ``motor.http.server``.

    ``status_lines``: the ``status -> b"HTTP/1.1 ... \\r\\n"`` cache that ``status_line``
    fills; ``status_line(int) -> bytes``; ``origin_form(method, target) -> bytes | None``;
    ``error_body(status, message) -> bytes``; ``logger``: a ``logging.Logger`` (handler
    failures); ``reset(transport)``: make the next close of a transport's socket a reset.
    Called once at import of ``motor.http.server``; again replaces them."""
    global _status_lines, _status_line, _origin_form, _error_body, _logger, _reset_socket
    _reset_socket = reset
    _status_lines = status_lines
    _status_line = status_line
    _origin_form = origin_form
    _error_body = error_body
    _logger = logger


def bound():
    """True once :func:`bind` was called."""
    return _status_line is not None


cdef inline object _status(object status):
    line = _status_lines.get(status)
    if line is None:
        line = _status_line(status)
    return line


cdef bytes _hex_chunk(bytes data, bint last):
    """``b"%x\\r\\n%b\\r\\n" % (len(data), data)`` (+ ``b"0\\r\\n\\r\\n"`` when ``last``)."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef char digits[16]
    cdef int nd = 0
    cdef size_t v = <size_t>n
    cdef Py_ssize_t total, i
    cdef char *p
    while True:
        digits[nd] = b"0123456789abcdef"[v & 15]
        nd += 1
        v >>= 4
        if v == 0:
            break
    total = nd + 2 + n + 2 + (5 if last else 0)
    out = PyBytes_FromStringAndSize(NULL, total)
    p = PyBytes_AS_STRING(out)
    for i in range(nd):
        p[i] = digits[nd - 1 - i]
    p += nd
    p[0] = 13
    p[1] = 10
    p += 2
    memcpy(p, PyBytes_AS_STRING(data), n)
    p += n
    p[0] = 13
    p[1] = 10
    if last:
        memcpy(p + 2, b"0\r\n\r\n", 5)
    return <bytes>out


cdef bytes _decimal(Py_ssize_t n):
    """``b"%d" % n`` for ``n >= 0`` (a ``Content-Length`` value) without the formatter."""
    cdef char digits[24]
    cdef int nd = 0
    cdef size_t v = <size_t>n
    cdef int i
    while True:
        digits[nd] = 48 + <char>(v % 10)
        nd += 1
        v //= 10
        if v == 0:
            break
    out = PyBytes_FromStringAndSize(NULL, nd)
    cdef char *p = PyBytes_AS_STRING(out)
    for i in range(nd):
        p[i] = digits[nd - 1 - i]
    return <bytes>out


cdef inline object _chunk(object data, bint last):
    if type(data) is bytes:
        return _hex_chunk(<bytes>data, last)
    if last:
        return b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
    return b"%x\r\n%b\r\n" % (len(data), data)


cdef inline bytes _ascii_lower(bytes name):
    """``name.lower()``; ``name`` itself when it holds no upper-case ASCII letter."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(name), i
    cdef const unsigned char *s = <const unsigned char *>PyBytes_AS_STRING(name)
    for i in range(n):
        if 65 <= s[i] <= 90:
            return name.lower()
    return name


cdef inline long long _digits(bytes v):
    """The value of ``v`` when it is 1 to 18 ASCII digits, else -2 (ask ``int()``)."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(v), i
    cdef const unsigned char *s = <const unsigned char *>PyBytes_AS_STRING(v)
    cdef long long r = 0
    if n == 0 or n > 18:
        return -2
    for i in range(n):
        if not 48 <= s[i] <= 57:
            return -2
        r = r * 10 + (s[i] - 48)
    return r


# -- the common request's head, parsed without httptools ------------------------------------
# A request whose head and body are whole in one read and use nothing but the plainest
# HTTP/1.1 (the request line of a known method and an origin-form target, token header
# names, visible-ASCII values, Content-Length or no body, keep-alive) is parsed here in one
# pass; anything else, byte for byte from the start of that request, goes to httptools,
# which decides it exactly as before (a subset acceptor: it never answers differently, it
# only declines). The character classes and the header line: ``httpscan.pxd``.

cdef bytes _GET = b"GET"
cdef bytes _POST = b"POST"
cdef bytes _HEAD = b"HEAD"
cdef bytes _PUT = b"PUT"
cdef bytes _DELETE = b"DELETE"
cdef bytes _PATCH = b"PATCH"
cdef bytes _OPTIONS = b"OPTIONS"


cdef inline object _method(const char *s, Py_ssize_t n):
    """The method of a request line starting at ``s`` (``n``: bytes up to the first SP), as
    one of the constants above; None for any other (httptools decides those)."""
    if n == 3:
        if s[0] == 71 and s[1] == 69 and s[2] == 84:                     # GET
            return _GET
        if s[0] == 80 and s[1] == 85 and s[2] == 84:                     # PUT
            return _PUT
    elif n == 4:
        if memcmp(s, b"POST", 4) == 0:
            return _POST
        if memcmp(s, b"HEAD", 4) == 0:
            return _HEAD
    elif n == 5:
        if memcmp(s, b"PATCH", 5) == 0:
            return _PATCH
    elif n == 6:
        if memcmp(s, b"DELETE", 6) == 0:
            return _DELETE
    elif n == 7:
        if memcmp(s, b"OPTIONS", 7) == 0:
            return _OPTIONS
    return None


@cython.final
cdef class _Ready:
    """An awaitable that ends at once (``await`` takes no loop turn)."""

    def __await__(self):
        return _NO_WAIT


#: an exhausted iterator: awaiting :data:`_READY` ends at its first step, every time
cdef object _NO_WAIT = iter(())
cdef _Ready _READY = _Ready()
#: :data:`_READY` for Python: what :meth:`Response.drain` returns while the client's socket
#: takes data (the compiled SSE relay tells by it that it need not wait)
READY = _READY


@cython.final
cdef class Request:
    """One parsed HTTP request (as ``motor.http.server.Request``).

    Attributes: ``method`` (bytes, e.g. ``b"POST"``), ``path`` (str, without the query),
    ``query`` (str, raw, may be empty), ``headers`` (list of ``(name, value)`` bytes pairs in
    arrival order, names lower-cased), ``body`` (bytes, bounded by the server's
    ``max_body_bytes``), ``keep_alive`` (bool), ``peer`` (the transport's ``peername``),
    ``http10`` (bool: an HTTP/1.0 request)."""

    cdef public bytes method
    cdef public str path
    cdef public str query
    cdef public list headers
    cdef public bytes body
    cdef public bint keep_alive
    cdef public object peer
    cdef public bint http10

    def __init__(self, bytes method, str path, str query, list headers, bytes body,
                 bint keep_alive, object peer, bint http10=False):
        self.http10 = http10
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.peer = peer

    def header(self, name, default=None):
        """First value of header ``name`` (lower-case bytes), or ``default``."""
        cdef object k
        for item in self.headers:
            k, v = item
            if k == name:
                return v
        return default

    @cython.wraparound(True)      # v[-1]: the build turns wraparound off
    def query_params(self):
        """``{name: last value}`` of the query string (``urllib.parse.parse_qs``)."""
        return {k: v[-1] for k, v in _parse_qs(self.query).items()}


@cython.final
cdef class Response:
    """The answer to one request (as ``motor.http.server.Response``); exactly one of
    ``send`` or ``start``..``end`` is used. ``RuntimeError`` when a second answer starts."""

    cdef HttpProtocol _proto
    cdef public bint started
    cdef public bint finished
    cdef public object status
    cdef bint _chunked
    cdef public bint keep_alive
    cdef public bint http10
    cdef public bint head
    #: called with every body byte string sent (``send``, ``write``, ``end``); None = none
    cdef public object tap
    #: headers added to whatever answer is sent (the edge's ``x-ratelimit-*``)
    cdef public object extra_headers
    #: what a corked answer holds back (``cork``); None: every piece written at once
    cdef list _corked

    def __init__(self, HttpProtocol proto not None, bint keep_alive, bint http10=False):
        self._proto = proto
        self.http10 = http10
        self.head = False
        self.started = False
        self.finished = False
        self.status = 0
        self._chunked = False
        self.keep_alive = keep_alive
        self.tap = None
        self.extra_headers = ()

    cdef _end_head(self, list parts, headers):
        """The end of an answer's head into ``parts``: ``headers``, the extra headers, and
        ``connection: close`` when the connection goes with this answer (no keep-alive, or
        the server shutting down), then the blank line."""
        for k, v in headers:
            parts.append(k)
            parts.append(b": ")
            parts.append(v)
            parts.append(b"\r\n")
        if self.extra_headers:
            for k, v in self.extra_headers:
                parts.append(k)
                parts.append(b": ")
                parts.append(v)
                parts.append(b"\r\n")
        if self.keep_alive and self._proto._server.draining:
            self.keep_alive = False     # shutting down: say the connection goes with this answer
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")

    @property
    def client_gone(self):
        return self._proto.closed

    def cork(self):
        """Hold back what :meth:`start` and :meth:`write` send until :meth:`flush` or
        :meth:`end`, which write it in one piece (the reference's ``cork``)."""
        if self._corked is None:
            self._corked = []

    def flush(self):
        """Write what a corked answer holds back (it stays corked)."""
        cdef list c = self._corked
        if c:
            self._corked = []
            self._proto.write(c[0] if len(c) == 1 else mf_join(c))

    cdef inline _out(self, data):
        if self._corked is not None:
            self._corked.append(data)
        else:
            self._proto.write(data)

    def send(self, status, body=b"", content_type=b"application/json", headers=()):
        """Send a complete response with ``Content-Length``."""
        cdef list parts
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        parts = [_status(status), b"content-type: ", content_type,
                 b"\r\ncontent-length: ", _decimal(len(body)), b"\r\n"]
        self._end_head(parts, headers)
        if not self.head:
            parts.append(body)
        self._proto.write(mf_join(parts))
        if self.tap is not None:
            self.tap(body)
        self._proto.response_done(self)

    def start(self, status, content_type=b"text/event-stream", headers=()):
        """Start a chunked response; follow with :meth:`write` calls and one :meth:`end`."""
        cdef list parts
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.http10 or self.head:
            # an HTTP/1.0 client knows no chunked encoding: the body ends when we close
            self._chunked = False
            self.keep_alive = False
            parts = [_status(status), b"content-type: ", content_type, b"\r\n"]
        else:
            self._chunked = True
            parts = [_status(status), b"content-type: ", content_type,
                     b"\r\ntransfer-encoding: chunked\r\n"]
        if content_type == b"text/event-stream":
            parts.append(b"cache-control: no-cache\r\n")
        self._end_head(parts, headers)
        self._out(mf_join(parts))

    def write(self, data):
        """Send one chunk at once (held back while corked). Empty data is ignored."""
        if data and not self.head:
            if self._chunked:
                self._out(_chunk(data, False))
            else:
                self._out(data)
            if self.tap is not None:
                self.tap(data)

    def drain(self):
        """Wait while the client's socket buffer is full; ``ConnectionResetError`` when the
        client is gone. Returns what to await: an awaitable that ends at once while the
        socket takes data (no coroutine per call), else the wait."""
        cdef HttpProtocol proto = self._proto
        if proto.closed:
            raise ConnectionResetError("client closed the connection")
        if not proto._paused:
            return _READY
        return self._wait_drain()

    async def _wait_drain(self):
        cdef HttpProtocol proto = self._proto
        loop = _get_running_loop()
        proto._drain_waiter = loop.create_future()
        try:
            await proto._drain_waiter
        finally:
            proto._drain_waiter = None

    def end(self, data=b""):
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
            self._out(_chunk(data, True))
        else:
            self._out(_LAST_CHUNK)
        self.flush()
        self._corked = None
        self._proto.response_done(self)

    def abort(self):
        """Close the client connection (used when a started stream cannot be ended cleanly);
        what a corked answer held back is dropped."""
        self.finished = True
        self._corked = None
        self._proto.close()


@cython.final
cdef class HttpProtocol:
    """One client connection (as ``motor.http.server.HttpProtocol``): the ``asyncio``
    protocol methods, the ``httptools`` callbacks, and what ``HttpServer`` calls
    (``deadline``, ``send_deadline``, ``timed_out``, ``send_timed_out``, ``close``,
    ``idle``, ``closed``). Compiled only: ``plain_requests``, how many of the connection's
    requests the plain-request scanner parsed (the rest went through httptools)."""

    cdef object _server
    cdef object _transport
    cdef object _parser
    cdef bytes _url
    cdef list _headers
    cdef list _body
    cdef Py_ssize_t _body_len
    cdef object _queue
    #: the connection's task: answers its requests one after another, parked on
    #: ``_waiter`` between them (one task per connection, not one per request)
    cdef object _task
    #: set while the connection's task is parked waiting for the next request
    cdef object _waiter
    #: the request (and its response) handed to the parked task
    cdef Request _next_req
    cdef Response _next_resp
    #: a request is being answered (its response not finished yet)
    cdef bint _busy
    cdef Response _current
    cdef public bint closed
    cdef bint _paused
    cdef object _drain_waiter
    cdef object _peer
    cdef bint _rejected
    #: loop time after which the server's sweeper closes this connection (0 = none)
    cdef public double deadline
    cdef bint _reading
    #: loop time after which a client that stopped reading is cut (0 = not stalled)
    cdef public double send_deadline
    cdef Py_ssize_t _head_len
    cdef object _deferred
    #: httptools holds part of a request (between its on_message_begin and complete)
    cdef bint _in_msg
    #: requests of this connection parsed by the plain-request scanner (not httptools)
    cdef readonly Py_ssize_t plain_requests
    #: the event loop of the connection (taken once: ``get_running_loop`` makes a getpid
    #: system call each time)
    cdef object _loop

    def __init__(self, server):
        if _status_line is None:
            raise RuntimeError("motor._fast.http1 is not bound: import motor.http.server")
        self._server = server
        self._transport = None
        self._parser = _HttpRequestParser(self)
        self._url = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._queue = _deque()
        self._task = None
        self._waiter = None
        self._next_req = None
        self._next_resp = None
        self._busy = False
        self._current = None
        self.closed = False
        self._paused = False
        self._drain_waiter = None
        self._peer = None
        self._rejected = False
        self.deadline = 0.0
        self._reading = False
        self.send_deadline = 0.0
        self._head_len = 0
        self._deferred = None
        self._in_msg = False
        self.plain_requests = 0
        self._loop = None

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport):
        self._transport = transport
        try:
            self._loop = _get_running_loop()
        except RuntimeError:        # made outside a loop (tests): taken at the first request
            self._loop = None
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in _AF_INETS:
            try:
                sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
            except OSError:
                pass
        server = self._server
        server.connections.add(self)
        self.deadline = server.loop_time() + server.keepalive_timeout_s

    def data_received(self, data):
        cdef Py_ssize_t taken
        if self._rejected:
            return
        if not self._in_msg and type(data) is bytes:
            taken = self._plain_requests(<bytes>data)
            if taken:
                if taken == PyBytes_GET_SIZE(data) or self._rejected:
                    return
                data = data[taken:]
        try:
            self._parser.feed_data(data)
        except _HttpParserUpgrade:
            if self._busy:
                # the request asking for it is answered as plain HTTP/1.1 (a server may ignore
                # Upgrade, RFC 9110 section 7.8); what follows it is no HTTP/1.1: the
                # connection closes after the answers
                self._rejected = True
                if self._deferred is None:
                    self._deferred = _CLOSE
            else:
                self._reject(400, "protocol upgrade is not supported")
        except _HttpParserError as e:
            self._reject(400, f"malformed HTTP request: {e}")

    def eof_received(self):
        return None

    def connection_lost(self, exc):
        self.closed = True
        self._server.connections.discard(self)
        if self._busy and self._task is not None and not self._task.done():
            self._task.cancel()
        self._unpark()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client closed the connection"))
        self._queue.clear()

    def pause_writing(self):
        self._paused = True
        t = self._server.send_timeout_s
        if t:
            self.send_deadline = self._server.loop_time() + t

    def resume_writing(self):
        self._paused = False
        self.send_deadline = 0.0
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks ------------------------------------------------
    def on_message_begin(self):
        self._in_msg = True
        server = self._server
        self.deadline = server.loop_time() + server.request_read_timeout_s
        self._reading = True
        self._url = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._head_len = 0

    def on_url(self, bytes url):
        if PyBytes_GET_SIZE(self._url) == 0:
            self._url = url
        else:
            self._url += url
        self._count_head(PyBytes_GET_SIZE(url))

    def on_header(self, bytes name, value):
        self._headers.append((_ascii_lower(name), value))
        self._count_head(PyBytes_GET_SIZE(name) + len(value))

    cdef _count_head(self, Py_ssize_t n):
        self._head_len += n
        limit = self._server.max_header_bytes
        if self._head_len > limit and not self._rejected:
            self._reject(431, f"request header fields are larger than the limit of {limit} "
                              "bytes")

    def on_headers_complete(self):
        cdef long long n
        expect = None
        for item in self._headers:
            k, v = item
            if k == b"content-length":
                n = _digits(v) if type(v) is bytes else -2
                if n == -2:
                    try:
                        n_obj = int(v)
                    except ValueError:
                        n_obj = -1
                else:
                    n_obj = n
                limit = self._server.max_body_bytes
                if n_obj > limit:
                    # a final status before the body, also with Expect (RFC 9110 10.1.1)
                    self._reject(413, f"request body of {n_obj} bytes is larger than the limit "
                                      f"of {limit} bytes")
                    return
            elif k == b"expect":
                expect = v
        if expect is not None:
            self._expect(expect)

    cdef _expect(self, value):
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
                if len(final) == 2:
                    self._reject(final[0], final[1])
                else:
                    status, message, headers = final
                    self._reject(status, message, headers)
                return
        if self._parser.get_http_version() != _HTTP10 and not self._busy \
                and self._transport is not None and not self.closed:
            self._transport.write(_CONTINUE)

    def on_body(self, body):
        if self._rejected:
            return
        self._body_len += len(body)
        limit = self._server.max_body_bytes
        if self._body_len > limit:
            self._reject(413, f"request body is larger than the limit of {limit} bytes")
            return
        self._body.append(body)

    def on_message_complete(self):
        cdef bytes url
        cdef Py_ssize_t n
        self._in_msg = False
        if self._rejected:
            return
        self.deadline = 0.0  # a handler runs: no read deadline until it answered
        self._reading = False
        parser = self._parser
        method = parser.get_method()
        url = self._url
        n = PyBytes_GET_SIZE(url)
        if n == 0 or PyBytes_AS_STRING(url)[0] != 47:     # not b"/"
            # not origin-form (RFC 9112 section 3.2): absolute-form is reduced to its path
            # and query, ``*`` stays for OPTIONS, anything else is a 400
            target = _origin_form(method, url)
            if target is None:
                self._reject(400, f"malformed request target {url[:200].decode('latin-1')!r}: "
                                  "expected /path, http(s)://host/path, or * with OPTIONS")
                return
            url = target
            n = PyBytes_GET_SIZE(url)
        body = self._body
        self._complete(method, url, self._headers,
                       body[0] if len(body) == 1 else mf_join(body),
                       parser.should_keep_alive(), parser.get_http_version() == _HTTP10)

    # -- internals ----------------------------------------------------------
    cdef _complete(self, bytes method, bytes url, list headers, bytes body, bint keep_alive,
                   bint http10):
        """A whole request (``url`` in origin form): start it, or queue it behind the one
        being answered (429 past 64)."""
        cdef const char *s = PyBytes_AS_STRING(url)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(url)
        cdef const char *q
        cdef Request req = Request.__new__(Request)
        q = <const char *>memchr(s, 63, n)     # b"?"
        if q != NULL:
            req.path = PyUnicode_DecodeLatin1(s, q - s, NULL)
            req.query = PyUnicode_DecodeLatin1(q + 1, n - (q - s) - 1, NULL)
        else:
            req.path = PyUnicode_DecodeLatin1(s, n, NULL)
            req.query = ""
        req.body = body
        req.method = method
        req.headers = headers
        req.keep_alive = keep_alive
        req.peer = self._peer
        req.http10 = http10
        if not self._busy:
            self._start(req)
        elif len(self._queue) >= 64:
            self._reject(429, "too many pipelined requests")
        else:
            self._queue.append(req)

    cdef Py_ssize_t _plain_requests(self, bytes data):
        """Parse and start the plain requests whole at the start of ``data`` (the module's
        section on them); returns the bytes taken. The rest, from the first request this
        declines (or a refusal), is httptools'."""
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0, taken
        while pos < n and not self._rejected:
            taken = self._plain_request(data, pos, n)
            if taken == 0:
                break
            pos += taken
        return pos

    cdef Py_ssize_t _plain_request(self, bytes data, Py_ssize_t pos, Py_ssize_t n):
        """One plain request at ``data[pos:n]``: started (or queued), returns its length
        in bytes; 0 when it is not plain or not whole (nothing done)."""
        cdef const unsigned char *b = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t i, j, url_start, url_end, name_start, nlen, colon, vs, ve, head_bytes, k
        cdef long long body_len = -1
        cdef bytes name
        cdef char *w
        cdef list headers
        # request line: METHOD SP /target SP HTTP/1.1 CRLF
        j = pos
        while j < n and j - pos < 8 and b[j] != 32:
            j += 1
        if j >= n or b[j] != 32:
            return 0
        method = _method(<const char *>b + pos, j - pos)
        if method is None:
            return 0
        url_start = j + 1
        if url_start >= n or b[url_start] != 47:     # b"/": origin form only
            return 0
        j = url_start + 1
        while j < n and hs_pchar[b[j]]:
            j += 1
        url_end = j
        if j + 11 > n or memcmp(b + j, b" HTTP/1.1\r\n", 11) != 0:
            return 0
        i = j + 11
        head_bytes = url_end - url_start
        headers = []
        while True:
            if i + 2 > n:
                return 0
            if b[i] == 13:
                if b[i + 1] != 10:
                    return 0
                i += 2
                break
            name_start = i
            i = hs_header_line(b, i, n, &colon, &vs, &ve)
            if i < 0:
                return 0
            nlen = colon - name_start
            name = hs_lower_name(b, name_start, nlen)
            w = PyBytes_AS_STRING(name)
            # the headers httptools gives a meaning to: declined, but for a plain
            # Content-Length and Connection: keep-alive
            if nlen == 14 and memcmp(w, b"content-length", 14) == 0:
                if body_len != -1:
                    return 0
                body_len = hs_length(b, vs, ve)
                if body_len < 0:
                    return 0
            elif nlen == 10 and memcmp(w, b"connection", 10) == 0:
                if not hs_is_keep_alive(b + vs, ve - vs):
                    return 0
            elif (nlen == 17 and memcmp(w, b"transfer-encoding", 17) == 0) \
                    or (nlen == 6 and memcmp(w, b"expect", 6) == 0) \
                    or (nlen == 7 and memcmp(w, b"upgrade", 7) == 0) \
                    or (nlen == 16 and memcmp(w, b"proxy-connection", 16) == 0):
                return 0
            headers.append((name, PyBytes_FromStringAndSize(<const char *>b + vs, ve - vs)))
            head_bytes += nlen + ve - vs
        server = self._server
        if head_bytes > server.max_header_bytes:
            return 0
        if body_len < 0:
            body_len = 0
        elif body_len > server.max_body_bytes:
            return 0
        if i + body_len > n:
            return 0
        self.deadline = 0.0  # a handler runs: no read deadline until it answered
        self._reading = False
        self.plain_requests += 1
        self._complete(method, PyBytes_FromStringAndSize(<const char *>b + url_start,
                                                         url_end - url_start),
                       headers,
                       PyBytes_FromStringAndSize(<const char *>b + i, body_len) if body_len
                       else _EMPTY, True, False)
        return i + body_len - pos

    cdef _start(self, Request req):
        cdef Response resp = Response.__new__(Response)
        resp._proto = self
        resp.http10 = req.http10
        resp.status = 0
        resp.extra_headers = ()
        if self._server.draining:
            # shutting down: a request that arrives now (kept-alive or pipelined connection)
            # is answered 503 at once, never started and cut at the drain deadline (case N10)
            resp.keep_alive = False
            self._current = resp
            resp.send(503, _error_body(503, "the server is shutting down; retry elsewhere"))
            return
        resp.keep_alive = req.keep_alive
        self._current = resp
        self._busy = True
        w = self._waiter
        if w is not None:
            # the connection's task waits for its next request: handed over, no new task
            self._waiter = None
            self._next_req = req
            self._next_resp = resp
            w.set_result(None)
            return
        loop = self._loop
        if loop is None:
            loop = self._loop = _get_running_loop()
        self._task = loop.create_task(self._serve(req, resp))

    cdef _unpark(self):
        """End the connection's task if it waits for a next request (the connection
        closes)."""
        w = self._waiter
        if w is not None:
            self._waiter = None
            w.cancel()

    async def _serve(self, Request req, Response resp):
        """The connection's task: answers ``req``, then each request handed over by
        :meth:`_start` while it waits. It ends when the connection closes, when a request
        started while its handler still ran (pipelined, or sent right after an answer the
        handler outlived: that one has a task of its own, as before), or when a handler left
        a cancellation request on it (``Task.cancelling``: the union path tells an eviction
        from its client leaving by ``Task.uncancel() == 0``, which a leftover request would
        break for the next request)."""
        server = self._server
        task = self._task      # this task: set by create_task before the first step
        while True:
            # counted inside the coroutine: a task cancelled before its first step (the
            # client left in the same loop tick) never runs its finally, so it must not have
            # counted either
            server.inflight += 1
            try:
                await server.handler(req, resp)
            except _CancelledError:
                if not resp.finished and not self.closed:
                    self.close()
                raise
            except Exception:
                _logger.exception("handler failed for %s %s", req.method.decode(), req.path)
                if not resp.started and not self.closed:
                    resp.send(500, _error_body(500, "internal error in motor"))
                elif not resp.finished:
                    resp.abort()
                cb = server.on_handler_error     # (motor.http.server.handler_failed)
                if cb is not None:
                    try:
                        cb(req)
                    except Exception:
                        _logger.exception("on_handler_error failed for %s", req.path)
            finally:
                server.inflight -= 1
                if not resp.finished and not self.closed:
                    # a handler that returned without answering: never leave the client
                    # hanging
                    if not resp.started:
                        resp.send(500, _error_body(500, "no response produced"))
                    else:
                        resp.abort()
            req = None
            resp = None
            if self._task is not task or self._busy or self.closed or task.cancelling():
                return
            w = self._loop.create_future()
            self._waiter = w
            try:
                await w
            except _CancelledError:
                # closed while waiting (close / connection_lost), or the task cancelled
                if self._waiter is w:
                    self._waiter = None
                return
            req = self._next_req
            resp = self._next_resp
            self._next_req = None
            self._next_resp = None

    cpdef response_done(self, Response resp):
        """The answer ``resp`` was sent: close (no keep-alive, draining), start the next
        pipelined request, or wait for one."""
        self._busy = False
        self._current = None
        server = self._server
        if not resp.keep_alive or server.draining:
            self.close()      # draining: the connection goes with its last answer
            return
        if self._queue and not self.closed:
            self._start(self._queue.popleft())
        elif self._deferred is not None:
            # the requests before a refused one are answered: now its answer, and the close
            d = self._deferred
            self._deferred = None
            if d is _CLOSE:
                self.close()
            else:
                status, message, headers = d
                self._reject(status, message, headers)
        else:
            self.deadline = server.loop_time() + server.keepalive_timeout_s

    cdef _reject(self, status, message, headers=()):
        """Answer an unparsable / oversized / refused request and close the connection;
        ``message``: text for an OpenAI error body, or the whole JSON body as bytes."""
        cdef list extra
        self._rejected = True
        if self._transport is None or self.closed:
            return
        if self._busy:
            # pipelined after requests still being answered: their answers go first
            # (response_done), then this one, and the connection closes
            if self._deferred is None:
                self._deferred = (status, message, headers)
            return
        body = message if isinstance(message, bytes) else _error_body(status, message)
        extra = []
        for k, v in headers:
            extra.append(k + b": " + v + b"\r\n")
        self._transport.write(_status(status) + b"content-type: application/json\r\n"
                              b"content-length: " + str(len(body)).encode() +
                              b"\r\n" + _EMPTY.join(extra) + b"connection: close\r\n\r\n"
                              + body)
        self._linger()

    cdef _linger(self):
        """After a refusal (as the reference): shut the write side once the answer is out and
        drop what the client still sends for up to ``LINGER_S``, then close (the sweeper's
        deadline); a transport that cannot half-close (TLS) is closed at once."""
        t = self._transport
        try:
            if t is not None and t.can_write_eof():
                t.write_eof()
                self.closed = True
                self._reading = False
                self.deadline = self._server.loop_time() + _LINGER_S
                return
        except (NotImplementedError, OSError, RuntimeError):
            pass
        self.close()

    def timed_out(self):
        """Called by the sweeper when :attr:`deadline` passed."""
        self.deadline = 0.0
        if self._reading:
            self._reject(408, f"request not received in full within "
                              f"{self._server.request_read_timeout_s:g} s")
        else:
            self.close()

    def send_timed_out(self):
        """Called by the sweeper: the client read nothing for ``send_timeout_s`` while answers
        waited in its socket buffer; the connection is aborted."""
        self.send_deadline = 0.0
        _logger.info("client %s stopped reading for %g s: connection closed", self._peer,
                     self._server.send_timeout_s)
        if self._transport is not None:
            if _reset_socket is not None:
                _reset_socket(self._transport)
            self._transport.abort()

    cpdef write(self, data):
        """Write ``data`` to the client unless the connection is closed."""
        if not self.closed and self._transport is not None:
            self._transport.write(data)

    async def drain(self):
        """Wait while the client's socket buffer is full; ``ConnectionResetError`` when the
        client is gone."""
        if self.closed:
            raise ConnectionResetError("client closed the connection")
        if not self._paused:
            return
        loop = _get_running_loop()
        self._drain_waiter = loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    cpdef close(self):
        """Close the transport (once); :attr:`closed` is True from now on."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
        self.closed = True
        self._unpark()

    cpdef bint idle(self):
        """No request being answered and none queued."""
        return not self._busy and not self._queue
