# cython: language_level=3
"""The pooled HTTP/1.1 upstream client of :mod:`motor.http.client`, compiled.

:class:`Conn`, :class:`UpstreamResponse` and :class:`Pool` behave exactly as the pure-Python
``_Conn``, ``UpstreamResponse`` and ``Pool`` of ``motor/http/client.py`` (the reference:
the same bytes on the wire, the same attributes and methods, the same exceptions raised at
the same points); the client tests run against both. What differs is the cost per request:
typed attributes read as C struct fields, the ``httptools`` callbacks and the pool's
bookkeeping are C calls, ``Pool.request`` and ``UpstreamResponse.next_chunk`` / ``read``
are Cython coroutines that take an idle pooled connection and wait on the connection's
future without a nested coroutine per step.

The parser is ``httptools.HttpResponseParser`` through its Python interface (the same
parser and errors as the reference), but for the plainest answers: a response whole in one
read (``HTTP/1.1``, a final status other than 204 / 304, token header names, visible-ASCII
values, a ``Content-Length`` body, nothing after it) is taken in one C pass by
:meth:`Conn._plain_response` (a subset acceptor, as the server's plain-request scanner: what
it declines goes to httptools from its first byte). This module imports nothing from ``motor``:
``motor.http.client`` hands it, once, with :func:`bind`, its exception classes
(``UpstreamTimeout``, ``UpstreamClosed``), so ``except UpstreamClosed`` catches what
either implementation raises.

Public interface (see the stub ``upstream.pyi``): ``Pool(host, port, max_connections=1024,
connect_timeout_s=5.0, tls=None, pool_wait_s=None, max_idle=1024)`` with ``request``,
``close``, ``open_connections``, ``idle_connections``; ``UpstreamResponse`` with
``status``, ``headers``, ``header``, ``next_chunk``, ``read``, ``close``, async iteration
and the async context manager; ``Conn(pool)``, the ``asyncio.Protocol`` of one connection
(duck typed: a cdef class cannot derive from ``asyncio.Protocol``).
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcmp

from motor._fast._common cimport mf_join

from motor._fast.httpscan cimport (hs_header_line, hs_is_keep_alive, hs_is_word,
                                    hs_length, hs_lower_name, hs_vchar)

import asyncio
import socket
from collections import deque

import httptools

cdef object _HttpResponseParser = httptools.HttpResponseParser
cdef object _HttpParserError = httptools.HttpParserError
cdef object _HttpParserUpgrade = httptools.HttpParserUpgrade
cdef object _get_running_loop = asyncio.get_running_loop
cdef object _wait_for = asyncio.wait_for
cdef object _ensure_future = asyncio.ensure_future
cdef object _deque = deque
cdef object _AF_INETS = (socket.AF_INET, socket.AF_INET6)
cdef object _IPPROTO_TCP = socket.IPPROTO_TCP
cdef object _TCP_NODELAY = socket.TCP_NODELAY

# bound once by motor.http.client (bind)
cdef object _UpstreamTimeout = None
cdef object _UpstreamClosed = None

cdef Py_ssize_t _HIGH_WATER = 1 << 20  # pause reading an upstream socket above 1 MiB unread
cdef bytes _EMPTY = b""
cdef str _IDLE = "idle"
cdef str _FIRST_BYTE = "first byte"
cdef object _WAIT = object()      # UpstreamResponse._step: nothing yet, wait for the socket
# where a plain chunked body is (Conn.ch_state): not in one, at a chunk-size line, inside a
# chunk's data, at the CRLF after it, after the last chunk (only its CRLF may follow)
cdef enum:
    _CH_NONE = 0
    _CH_SIZE = 1
    _CH_DATA = 2
    _CH_DATA_END = 3
    _CH_LAST = 4
#: the head httptools is given when it takes over a plain chunked body (its callbacks
#: ignored: the real head was taken already)
cdef bytes _CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def bind(upstream_timeout not None, upstream_closed not None):
    """Give the compiled client the exception classes of ``motor.http.client``:
    ``upstream_timeout(phase, timeout_s)`` and ``upstream_closed(msg, *, before_response)``.
    Called once at import of ``motor.http.client``; again replaces them."""
    global _UpstreamTimeout, _UpstreamClosed
    _UpstreamTimeout = upstream_timeout
    _UpstreamClosed = upstream_closed


def bound():
    """True once :func:`bind` was called."""
    return _UpstreamClosed is not None


async def _connect_evictable(Conn conn, loop, made):
    """Wait for ``made`` (the connect) on ``conn``'s waiter, which ``Pool.evict`` fails (as
    ``motor.http.client.Pool._connect_evictable``): the connect runs in a task of its own,
    cancelled when the wait ends first; a connection made after that is closed."""
    w = conn.waiter = loop.create_future()
    t = _ensure_future(made)

    def done(t):
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


def _expire_wait(fut, wait_s):
    if not fut.done():
        fut.set_exception(_UpstreamTimeout("pool", wait_s))


cdef inline bytes _ascii_lower(bytes name):
    """``name.lower()``; ``name`` itself when it holds no upper-case ASCII letter."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(name), i
    cdef const unsigned char *s = <const unsigned char *>PyBytes_AS_STRING(name)
    for i in range(n):
        if 65 <= s[i] <= 90:
            return name.lower()
    return name


cdef inline int _hex(unsigned char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef class ChunkSink:
    """Takes a response's body pieces in the connection's ``data_received`` while its
    reader waits (the compiled SSE relay, ``relay.pyx``): set as ``Conn.sink`` before the
    reader awaits the future of :meth:`UpstreamResponse._next_or_wait`. :meth:`take`
    returns 1 to take the next piece the same way, 0 to stop: the connection then drops
    the sink and wakes the reader (which finds why in the sink). It must not raise."""

    cdef int take(self, bytes data) except -1:
        return 0


@cython.final
cdef class Conn:
    """One upstream connection (as ``motor.http.client._Conn``); the protocol object is also
    the response's data source."""

    #: httptools holds part of an answer (between its on_message_begin and complete)
    #: answers on this connection taken by the plain-response scanner (not httptools)
    # a plain chunked body being decoded here (``_plain_chunks``): where in it (``_CH_*``),
    # the data left of the current chunk, the start of a size line cut by a read
    # httptools taking over a plain chunked body: its head was made up (its callbacks
    # ignored), and so was ``ch_mute`` bytes of chunk data (not the engine's)
    # the wait's bound (:meth:`_arm`): loop time it expires (0: none), what it raises, and
    # the one timer of this connection, armed at ``timer_at``, that checks it

    def __init__(self, Pool pool not None):
        if _UpstreamClosed is None:
            raise RuntimeError("motor._fast.upstream is not bound: import motor.http.client")
        self.pool = pool
        self.transport = None
        self.parser = _HttpResponseParser(self)
        self.closed = False
        self.counted_out = False
        self.loop = None
        self.timer_h = None
        self.in_msg = False
        self.plain_responses = 0
        self.pumped = 0
        self._reset()

    cdef _reset(self):
        self.status = 0
        self.headers = []
        self.chunks = []
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.error = None
        self.waiter = None
        self.paused = False
        self.got_bytes = False
        self.keep_alive = True
        self.interim = False
        self.deadline = 0.0
        self.ch_state = _CH_NONE
        self.ch_left = 0
        self.ch_line = None
        self.mute_head = False
        self.ch_mute = 0
        self.sink = None
        self.owner = None
        self.evicted = None

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in _AF_INETS:
            try:
                sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data):
        self.got_bytes = True
        if self.ch_state != _CH_NONE:
            if type(data) is bytes:
                self._plain_chunks(<bytes>data, 0)
            else:
                self._plain_chunks(bytes(data), 0)
            return
        if not self.in_msg and not self.headers_done and type(data) is bytes \
                and self._plain_response(<bytes>data):
            return
        self._feed(data)

    cdef _feed(self, data):
        """``data`` to httptools; a parse error ends the answer as malformed."""
        try:
            self.parser.feed_data(data)
        except (_HttpParserError, _HttpParserUpgrade) as e:
            # an upgrade (101) is never asked for: the bytes after it are no HTTP answer
            self.error = _UpstreamClosed(f"malformed HTTP response from upstream: {e}",
                                         before_response=not self.headers_done)
            self.close()
            self._wake()

    def eof_received(self):
        return None

    def connection_lost(self, exc):
        self.closed = True
        self._stop_timer()
        self.pool._forget(self)
        if not self.complete and self.error is None:
            if self.headers_done and not self.parser.should_keep_alive() \
                    and not self._has_length_or_chunked():
                # close-delimited body: the close is the end of the message
                self.complete = True
            else:
                self.error = _UpstreamClosed(
                    "upstream closed the connection" + (f": {exc}" if exc else ""),
                    before_response=not self.got_bytes)
        self._wake()

    cdef bint _plain_response(self, bytes data):
        """``data`` is one whole plain answer (``HTTP/1.1 NNN reason``, a final status other
        than 204 and 304, plain header lines, ``Content-Length`` of at most 1 MiB, the body,
        nothing after it) or the whole plain head of a chunked one (``Transfer-Encoding:
        chunked``, its body decoded here as it comes, :meth:`_plain_chunks`): taken as
        httptools' callbacks would have left it, True. False, nothing done, for anything
        else (httptools' to parse)."""
        cdef const unsigned char *b = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), i, name_start, nlen, colon, vs, ve, k
        cdef long long body_len = -1
        cdef int status
        cdef bint chunked = False
        cdef bytes name
        cdef char *w
        cdef list headers
        if self.complete or self.error is not None or n < 16 \
                or memcmp(b, b"HTTP/1.1 ", 9) != 0:
            return False
        if not (50 <= b[9] <= 53 and 48 <= b[10] <= 57 and 48 <= b[11] <= 57):   # 200-599
            return False
        status = (b[9] - 48) * 100 + (b[10] - 48) * 10 + (b[11] - 48)
        if status == 204 or status == 304:
            return False
        i = 12
        if b[i] == 32:
            i += 1
            while i < n and hs_vchar[b[i]]:
                i += 1
        headers = []
        if i + 2 > n or b[i] != 13 or b[i + 1] != 10:
            return False
        i += 2
        while True:
            if i + 2 > n:
                return False
            if b[i] == 13:
                if b[i + 1] != 10:
                    return False
                i += 2
                break
            name_start = i
            i = hs_header_line(b, i, n, &colon, &vs, &ve)
            if i < 0:
                return False
            nlen = colon - name_start
            name = hs_lower_name(b, name_start, nlen)
            w = PyBytes_AS_STRING(name)
            if nlen == 14 and memcmp(w, b"content-length", 14) == 0:
                if body_len != -1:
                    return False
                body_len = hs_length(b, vs, ve)
                if body_len < 0:
                    return False
            elif nlen == 10 and memcmp(w, b"connection", 10) == 0:
                if not hs_is_keep_alive(b + vs, ve - vs):
                    return False
            elif nlen == 17 and memcmp(w, b"transfer-encoding", 17) == 0:
                if chunked or not hs_is_word(b + vs, ve - vs, b"chunked", 7):
                    return False
                chunked = True
            elif (nlen == 7 and memcmp(w, b"upgrade", 7) == 0) \
                    or (nlen == 16 and memcmp(w, b"proxy-connection", 16) == 0):
                return False
            headers.append((name, PyBytes_FromStringAndSize(<const char *>b + vs, ve - vs)))
        if chunked:
            if body_len != -1:
                return False
            self.status = status
            self.headers = headers
            self.headers_done = True
            self.keep_alive = True
            self.plain_responses += 1
            self.ch_state = _CH_SIZE
            self._wake()
            if i < n:
                self._plain_chunks(data, i)
            return True
        if body_len < 0 or body_len > _HIGH_WATER or i + body_len != n:
            return False
        self.status = status
        self.headers = headers
        self.headers_done = True
        self.keep_alive = True
        if body_len:
            self.chunks.append(PyBytes_FromStringAndSize(<const char *>b + i, n - i))
            self.buffered += body_len
        self.complete = True
        self.plain_responses += 1
        self._wake()
        return True

    cdef _plain_chunks(self, bytes data, Py_ssize_t i):
        """Decode ``data[i:]``, the next bytes of a plain chunked body: each chunk's data
        as httptools' ``on_body`` would take it, the end of the message after the last
        chunk's CRLF. What this does not take (a chunk extension, trailer fields, a size that
        is not 1 to 7 hex digits, anything but CRLF where one belongs, bytes after the end)
        goes to httptools with a made-up head and, inside a chunk's data, a made-up chunk,
        so it answers as it would have from the start (their callbacks ignored)."""
        cdef const unsigned char *b = <const unsigned char *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), j, take, size
        cdef int h
        cdef bint body = False
        cdef bytes line
        if self.ch_line is not None:        # a size line cut by the last read
            line = self.ch_line
            self.ch_line = None
            data = line + data[i:]
            b = <const unsigned char *>PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
            i = 0
        while i < n:
            if self.ch_state == _CH_DATA:
                take = self.ch_left if self.ch_left < n - i else n - i
                self.chunks.append(data if i == 0 and take == n else
                                   PyBytes_FromStringAndSize(<const char *>b + i, take))
                self.buffered += take
                body = True
                self.ch_left -= take
                i += take
                if self.ch_left == 0:
                    self.ch_state = _CH_DATA_END
            elif self.ch_state == _CH_SIZE:
                j = i
                size = 0
                while j < n and j - i < 8:
                    h = _hex(b[j])
                    if h < 0:
                        break
                    size = (size << 4) | h
                    j += 1
                if j == n:                  # cut by the read: wait for the rest
                    if j - i < 8:
                        self.ch_line = data[i:]
                        break
                    return self._to_httptools(data, i, body)
                if j == i or j - i > 7 or b[j] != 13:
                    return self._to_httptools(data, i, body)
                if j + 1 == n:
                    self.ch_line = data[i:]
                    break
                if b[j + 1] != 10:
                    return self._to_httptools(data, i, body)
                i = j + 2
                if size == 0:
                    self.ch_state = _CH_LAST
                else:
                    self.ch_state = _CH_DATA
                    self.ch_left = size
            else:                           # _CH_DATA_END or _CH_LAST: a CRLF
                if b[i] != 13 or (i + 1 < n and b[i + 1] != 10):
                    return self._to_httptools(data, i, body)
                if i + 1 == n:
                    self.ch_line = data[i:]
                    break
                i += 2
                if self.ch_state == _CH_LAST:
                    self.ch_state = _CH_NONE
                    if i < n:               # bytes after the answer: httptools' to refuse
                        self._to_httptools(data, i, body, True)
                        return
                    self.complete = True
                    self._wake()
                    return
                self.ch_state = _CH_SIZE
        if body:
            self._body_added()

    cdef _to_httptools(self, bytes data, Py_ssize_t i, bint body, bint after_end=False):
        """httptools goes on from ``data[i:]`` inside the plain chunked body (at a size line,
        at the CRLF after a chunk's data, after the last chunk, or ``after_end``: past the
        answer's end); the body pieces taken so far are kept."""
        cdef int state = self.ch_state
        if body:
            self._body_added()
        self.ch_state = _CH_NONE
        if after_end:
            self.complete = True
            self._wake()
            self._feed(data[i:])
            return
        self.mute_head = True
        if state == _CH_SIZE:
            prefix = _CHUNKED_HEAD
        elif state == _CH_DATA_END:
            prefix = _CHUNKED_HEAD + b"1\r\n-"     # its data byte is not the engine's
            self.ch_mute = 1
        else:
            prefix = _CHUNKED_HEAD + b"0\r\n"
        self._feed(prefix + data[i:])

    cdef _body_added(self):
        """After body pieces were added: to the sink while its reader waits (no wake), else
        pause reading above the high-water mark and wake the reader."""
        cdef ChunkSink sink = self.sink
        if sink is not None:
            w = self.waiter
            if w is not None and not w.done():
                self._pump(sink)
                return
            self.sink = None
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    cdef _pump(self, ChunkSink sink):
        """The buffered body to ``sink`` now; when it stops, it is dropped and the reader
        woken. While it takes, the reader's wait bound (the idle timeout) counts from the
        last piece, as when the reader takes each piece itself."""
        cdef list chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else mf_join(chunks)
        self.chunks = []
        self.buffered = 0
        self.pumped += 1
        if sink.take(data) == 0:
            self.sink = None
            self._wake()
        elif self.deadline != 0.0:
            self._arm(self.due_s, <str>self.due_phase)

    # -- httptools callbacks ------------------------------------------------
    def on_message_begin(self):
        self.in_msg = True

    def on_status(self, status):
        if self.mute_head:
            return
        self.status = self.parser.get_status_code()

    def on_header(self, name, value):
        if self.mute_head:
            return
        if type(name) is bytes:
            self.headers.append((_ascii_lower(<bytes>name), value))
        else:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self):
        if self.mute_head:          # the made-up head of a plain body's takeover
            self.mute_head = False
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # an interim answer (100 Continue, 103 Early Hints): not the response, which
            # follows on the same connection; its headers are dropped (RFC 9110 section 15.2).
            # A 101 stops the parser (an upgrade never asked for): data_received answers it
            # as malformed.
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        self.keep_alive = bool(self.parser.should_keep_alive())
        self._wake()

    def on_body(self, body):
        if self.ch_mute:
            if len(body) <= self.ch_mute:
                self.ch_mute -= len(body)
                return
            body = body[self.ch_mute:]
            self.ch_mute = 0
        self.chunks.append(body)
        self.buffered += len(body)
        self._body_added()

    def on_message_complete(self):
        self.in_msg = False
        if self.interim:        # the 1xx ended: wait for the final answer's head
            self.interim = False
            self.status = 0
            return
        self.complete = True
        self._wake()

    # -- helpers ------------------------------------------------------------
    cdef bint _has_length_or_chunked(self):
        for item in self.headers:
            k, v = item
            if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
                return True
        return False

    cdef inline _wake(self):
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    cdef object _waiter(self):
        """A new future that the next wake sets (first step of ``wait``)."""
        if self.loop is None:
            self.loop = _get_running_loop()
        self.waiter = w = self.loop.create_future()
        return w

    cdef _arm(self, object timeout_s, str phase):
        """Bound the wait that starts now: ``UpstreamTimeout(phase, timeout_s)`` goes into the
        waiter when no wake came within ``timeout_s`` seconds (None or 0: no bound); the
        waiting code calls :meth:`_disarm` when woken.

        One timer per connection, not one per wait: a later deadline than the armed timer's
        is checked when it fires (and the timer re-armed for the rest); only an earlier one
        re-arms it now. A keep-alive connection's requests and a stream's chunks move the
        deadline forward without making a timer each (a uvloop ``TimerHandle`` and its
        cancel cost about as much as the rest of a chunk's relay)."""
        if not timeout_s:
            self.deadline = 0.0
            return
        loop = self.loop
        d = loop.time() + timeout_s
        self.deadline = d
        self.due_phase = phase
        self.due_s = timeout_s
        if self.timer_h is None or self.timer_at > d:
            if self.timer_h is not None:
                self.timer_h.cancel()
            self.timer_at = d
            self.timer_h = loop.call_at(d, self._on_timer)

    cdef inline _disarm(self):
        self.deadline = 0.0

    def _on_timer(self):
        """The connection's timer: the wait's deadline passed (its timeout into the waiter),
        moved later (armed again for it), or no wait is bounded now (nothing)."""
        self.timer_h = None
        d = self.deadline
        if d == 0.0 or self.closed:
            return
        if self.loop.time() < d:
            self.timer_at = d
            self.timer_h = self.loop.call_at(d, self._on_timer)
            return
        self.deadline = 0.0
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(_UpstreamTimeout(self.due_phase, self.due_s))

    cdef _stop_timer(self):
        if self.timer_h is not None:
            self.timer_h.cancel()
            self.timer_h = None

    async def wait(self, timeout_s, phase):
        """Wait for the next callback (headers, body, end, error, close) or the timeout.

        Raises ``UpstreamTimeout(phase, timeout_s)`` when ``timeout_s`` (seconds, None or 0 =
        no bound) passes first."""
        w = self._waiter()
        self._arm(timeout_s, phase)
        try:
            await w
        finally:
            self.waiter = None
            self._disarm()

    cpdef close(self):
        """Close the transport (once); the connection counts as closed from now on."""
        self.closed = True
        self._stop_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    cpdef bint reusable(self):
        """Open and not closing: fit for another request."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()


@cython.final
cdef class UpstreamResponse:
    """An engine's answer (as ``motor.http.client.UpstreamResponse``): ``status`` (int) and
    ``headers`` (list of ``(lower-case name, value)`` bytes pairs) now, body chunks as they
    come. Use as an async context manager or call :meth:`close` (idempotent); a response
    read to its end hands its connection back to the pool."""


    def __init__(self, Conn conn not None, idle_timeout_s):
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._idle_timeout_s = idle_timeout_s
        self._done = False

    @property
    def pumped(self):
        """Body pieces of this connection's answers so far taken by a sink in its
        ``data_received`` (the compiled SSE relay's: no wake of the reader each)."""
        return self._conn.pumped

    def header(self, name, default=None):
        """First value of header ``name`` (lower-case bytes), or ``default``."""
        for item in self.headers:
            k, v = item
            if k == name:
                return v
        return default

    cdef object _step(self):
        """One turn of ``next_chunk``'s loop without the wait: the buffered body, ``None`` at
        the end, the connection's error raised, or ``_WAIT``."""
        cdef Conn c = self._conn
        cdef list chunks = c.chunks
        if chunks:
            if len(chunks) == 1:
                data = chunks[0]
            else:
                data = mf_join(chunks)
            c.chunks = []
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
        return _WAIT

    cdef object _next_or_wait(self):
        """For a caller that waits itself (the compiled SSE relay): the next body piece
        (bytes), ``None`` at the end, or a future to await, the wait bounded by the idle
        timeout (it raises ``UpstreamTimeout``), then :meth:`_waited` and call again.
        Raises the connection's error."""
        cdef Conn c
        data = self._step()
        if data is not _WAIT:
            return data
        c = self._conn
        w = c._waiter()
        c._arm(self._idle_timeout_s, _IDLE)
        return w

    cdef _waited(self):
        """After the future of :meth:`_next_or_wait` is done (or its wait abandoned); a
        sink set for the wait is dropped."""
        self._conn.waiter = None
        self._conn.sink = None
        self._conn._disarm()

    async def next_chunk(self):
        """Next piece of the (de-chunked) body, or ``None`` at its end.

        Raises ``UpstreamTimeout`` (no byte for ``idle_timeout_s``), ``UpstreamClosed`` (the
        connection ended before the body was complete)."""
        while True:
            got = self._next_or_wait()
            if got is None or type(got) is bytes:
                return got
            try:
                await got
            finally:
                self._waited()

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        while True:
            chunk = await self.next_chunk()
            if chunk is None:
                return
            yield chunk

    def read_now(self):
        """The whole body (bytes) when all of it is here already (the answer complete, its
        connection handed back to the pool), else ``None`` and nothing changed: read it
        with :meth:`read`. A small answer usually comes with its head; this takes it
        without the coroutine of :meth:`read`."""
        cdef Conn c = self._conn
        if self._done or not c.complete or c.error is not None or c.paused:
            return None
        data = self._step()         # the buffered body, or None: nothing left (finished)
        if data is None:
            return _EMPTY
        self._finish()
        return data

    async def read(self):
        """The whole remaining body (bytes)."""
        cdef list parts = []
        cdef Conn c
        while True:
            data = self._step()
            if data is None:
                return mf_join(parts)
            if data is not _WAIT:
                parts.append(data)
                continue
            c = self._conn
            w = c._waiter()
            c._arm(self._idle_timeout_s, _IDLE)
            try:
                await w
            finally:
                c.waiter = None
                c._disarm()

    cdef _finish(self):
        if self._done:
            return
        self._done = True
        c = self._conn
        if c.complete and c.error is None and c.keep_alive:
            c.pool._release(c)
        else:
            c.close()
            c.pool._drop(c)

    def close(self):
        """Stop reading; an unfinished answer closes (aborts) the upstream connection."""
        if self._done:
            return
        c = self._conn
        if not c.complete:
            c.close()
        self._finish()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()


@cython.final
cdef class Pool:
    """Keep-alive connections to one endpoint (as ``motor.http.client.Pool``; parameters
    and errors there)."""


    def __init__(self, host, port, max_connections=1024, connect_timeout_s=5.0, tls=None,
                 pool_wait_s=None, max_idle=1024):
        if _UpstreamClosed is None:
            raise RuntimeError("motor._fast.upstream is not bound: import motor.http.client")
        self.host = host
        self.port = port
        self.tls = tls
        self.pool_wait_s = pool_wait_s
        self.max_idle = max_idle
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._idle = []
        self._open = 0
        self._waiters = _deque()
        self._conns = set()
        self._evictable = {}
        self._host_header = f"{host}:{port}".encode()
        self.closed = False

    @property
    def open_connections(self):
        return self._open

    @property
    def idle_connections(self):
        return len(self._idle)

    async def _connect(self, owner=None):
        loop = _get_running_loop()
        conn = Conn(self)
        conn.owner = owner
        self._conns.add(conn)
        try:
            made = _wait_for(
                loop.create_connection(lambda: conn, self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls else None),
                self.connect_timeout_s)
            if owner is None:
                await made
            else:
                await _connect_evictable(conn, loop, made)
        except TimeoutError:
            self._conns.discard(conn)
            raise _UpstreamTimeout("connect", self.connect_timeout_s) from None
        except BaseException:
            self._conns.discard(conn)
            raise
        return conn

    cdef Conn _pop_idle(self):
        """A reusable idle connection (the newest), or None; closed ones met are dropped."""
        cdef Conn c
        while self._idle:
            c = <Conn>self._idle.pop()
            if c.reusable():
                return c
            self._drop(c)
        return None

    async def _acquire(self, owner=None):
        cdef Conn c
        while True:
            c = self._pop_idle()
            if c is not None:
                return c, True
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await self._connect(owner), False
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
            loop = _get_running_loop()
            fut = loop.create_future()
            self._waiters.append(fut)
            entry = None
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
            if entry is not None and entry[1] is not None:
                # evicted after it was woken for a connection: the next waiter takes that one
                self._wake_one()
                raise entry[1]

    cdef _wake_one(self):
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    cdef _release(self, Conn c):
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

    cdef _drop(self, Conn c):
        self._conns.discard(c)
        if c.counted_out:
            return
        c.counted_out = True
        self._open -= 1
        self._wake_one()

    cdef _forget(self, Conn c):
        """Called on connection_lost: an idle connection closed by the engine leaves the pool."""
        try:
            self._idle.remove(c)
        except ValueError:
            return
        self._drop(c)

    async def request(self, method, path, body=b"", headers=(), *, first_byte_timeout_s=None,
                      idle_timeout_s=None, owner=None):
        """Send a request; return an :class:`UpstreamResponse` once status and headers
        arrived (as ``motor.http.client.Pool.request``: a reused keep-alive connection closed
        before any byte of the answer is retried once on a fresh one; ``owner``: what
        :meth:`evict` names to end it before its answer's head).

        Raises ``UpstreamTimeout`` (connect or first byte too slow), ``UpstreamClosed`` or
        ``OSError`` (connection refused / reset), ``UpstreamEvicted`` (:meth:`evict`)."""
        cdef list head
        cdef Conn conn
        cdef UpstreamResponse resp
        cdef bint reused
        cdef int attempt
        head = [method, b" ", path, b" HTTP/1.1\r\nhost: ", self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            head.append(k)
            head.append(b": ")
            head.append(v)
            head.append(b"\r\n")
        head.append(b"\r\n")
        head.append(body)
        data = mf_join(head)
        for attempt in range(2):
            conn = self._pop_idle()
            if conn is not None:
                reused = True
            else:
                conn, reused = await self._acquire(owner)
            conn.owner = owner
            try:
                assert conn.transport is not None
                conn.transport.write(data)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    w = conn._waiter()
                    conn._arm(first_byte_timeout_s, _FIRST_BYTE)
                    try:
                        await w
                    finally:
                        conn.waiter = None
                        conn._disarm()
            except _UpstreamClosed as e:
                conn.close()
                self._drop(conn)
                if reused and e.before_response and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                self._drop(conn)
                raise
            resp = UpstreamResponse.__new__(UpstreamResponse)
            resp._conn = conn
            resp.status = conn.status
            resp.headers = conn.headers
            resp._idle_timeout_s = idle_timeout_s
            resp._done = False
            return resp
        raise AssertionError("unreachable")  # pragma: no cover

    def evict(self, owner, exc):
        """End the requests made with ``owner`` whose answer's head has not come: ``exc``
        (an ``UpstreamEvicted``) is raised in each, as ``motor.http.client.Pool.evict``.
        Returns how many were ended (0 for owner ``None``: requests without one are never
        evicted)."""
        cdef Conn c
        cdef int n = 0
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

    def close(self):
        """Close the idle connections; callers waiting for one get ``ConnectionError``."""
        cdef Conn c
        self.closed = True
        while self._idle:
            c = <Conn>self._idle.pop()
            c.close()
            self._open -= 1
        for w in self._waiters:
            if not w.done():
                w.set_exception(ConnectionError("pool closed"))
        self._waiters.clear()
