# cython: language_level=3
"""The SSE relay of one stream leg, compiled.

:func:`relay_sse` is ``motor.coordinator.routing.base.relay_sse`` (the reference, which
says what it does and is used with the pure-Python client) over the compiled client's
:class:`~motor._fast.upstream.UpstreamResponse`: the same writes to the client, the same
returns and errors, the same observations, in the same order. What differs is the cost per
event: the loop is C; the next body piece is taken with the response's C method and its
future awaited here (no ``next_chunk`` coroutine per event); the client's ``drain`` is
awaited as the server's response returns it (no coroutine while the socket takes data).

While the relay waits for the engine, the pieces that arrive are relayed from the
connection's ``data_received`` itself (:class:`_Pump`, the connection's ``ChunkSink``):
the same code on the same state as the loop's, but no wake of the request's task (a turn
of the event loop, a future and a resume of every coroutine up to the server's) per
piece. The task wakes only to end the leg, for an error (raised where the loop would
have raised it), for a keep-alive step, or to wait for a slow client (``drain``). The
pieces run in a copy of the task's context (its context variables, read as they were).
A corked answer (``Response.cork``) is flushed as the reference flushes it, before every
wait, and after each piece taken in ``data_received``; within one turn of the relay's
task its writes go out together (its last ones with the caller's ``end``).

A recoverable stream's first leg (``StreamRecovery.scanning``) has its byte scanner
(:class:`motor._fast.sse.EventScanner`) called from here, as ``StreamRecovery.feed``
calls it, without a Python frame per piece.

This module imports nothing from ``motor`` outside ``motor._fast``:
``motor.coordinator.routing.base`` hands it, once, with :func:`bind`, the client's
exception classes, its ``Silence`` counter, the keep-alive comment, the largest event it
relays and the server's ready ``drain`` awaitable.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE


from libc.string cimport memchr, memcmp


cdef extern from "string.h" nogil:
    void *memrchr(const void *s, int c, size_t n)
    void *memmem(const void *h, size_t hn, const void *needle, size_t nn)
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit

from motor._fast.sse cimport EventScanner
from motor._fast.upstream cimport ChunkSink, UpstreamResponse

import time

cdef object _perf_counter = time.perf_counter

# bound once by motor.coordinator.routing.base (bind)
cdef object _UpstreamTimeout = None
cdef object _UpstreamClosed = None
cdef object _Silence = None
cdef bytes _KEEPALIVE = b""
cdef Py_ssize_t _MAX_EVENT = 0
cdef object _READY = None
cdef bytes _EMPTY = b""


def bind(upstream_timeout not None, upstream_closed not None, silence not None,
         bytes keepalive not None, Py_ssize_t max_event_bytes, ready=None):
    """Give the relay what it takes from ``motor``: ``UpstreamTimeout`` and
    ``UpstreamClosed`` (the classes the client raises), ``Silence(idle_timeout_s)`` (with
    ``waited(e)``), the keep-alive comment (bytes), the largest SSE event relayed (bytes)
    and ``ready``: what the compiled server's ``Response.drain`` returns while the client's
    socket takes data (None: every piece wakes the relay's task). Called once at import of
    the reference's module; again replaces them."""
    global _UpstreamTimeout, _UpstreamClosed, _Silence, _KEEPALIVE, _MAX_EVENT
    global _READY
    _UpstreamTimeout = upstream_timeout
    _UpstreamClosed = upstream_closed
    _Silence = silence
    _KEEPALIVE = keepalive
    _MAX_EVENT = max_event_bytes
    _READY = ready


def bound():
    """True once :func:`bind` was called."""
    return _Silence is not None


cdef Py_ssize_t _last_blank_line(bytes b) noexcept:
    """``b.rfind(b"\\n\\n")``: from the end by ``memrchr`` (a block nearly always ends with
    one: a step or two, where ``rfind`` costs about 500 instructions)."""
    cdef const char *p = PyBytes_AS_STRING(b)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(b)
    cdef const char *q
    while end >= 2:
        q = <const char *>memrchr(p + 1, 10, end - 1)     # the second "\n" of a pair
        if q == NULL:
            return -1
        if (q - 1)[0] == 10:
            return q - 1 - p
        end = q - p
    return -1


cdef Py_ssize_t _count(bytes b, const char *needle, Py_ssize_t k) noexcept:
    """``b.count(needle)`` (non-overlapping): its first byte by ``memchr``, the rest
    compared (``bytes.count`` costs about 950 instructions on an event, glibc's ``memmem``
    about 450 a call)."""
    cdef const char *p = PyBytes_AS_STRING(b)
    cdef const char *end = p + PyBytes_GET_SIZE(b)
    cdef const char *q
    cdef Py_ssize_t c = 0
    while end - p >= k:
        q = <const char *>memchr(p, needle[0], end - p - k + 1)
        if q == NULL:
            break
        if memcmp(q + 1, needle + 1, k - 1) == 0:
            c += 1
            p = q + k
        else:
            p = q + 1
    return c


#: the chat role preamble (``motor.coordinator.routing.base._ROLE_PREAMBLE``)
cdef bytes _ROLE_PREAMBLE = b'"role":"assistant","content":""'


cdef inline bint _blank(char c) noexcept nogil:
    """``bytes.strip``'s whitespace: space, \\t, \\n, \\r, \\x0b, \\x0c."""
    return c == 32 or 9 <= c <= 13


cdef bint _has_preamble(const char *p, Py_ssize_t n, const char *pre,
                        Py_ssize_t m) noexcept nogil:
    """Whether ``pre`` (the role preamble, ``"r...``) is in ``p[:n]``: ``memchr`` for its
    ``r`` (rare in an event: glibc's ``memmem`` cost ~1.7 k instructions an event), then
    the compare."""
    cdef const char *q = p + 1
    cdef const char *last = p + n - m + 2      # one past the last place its "r" can be
    while q < last:
        q = <const char *>memchr(q, pre[1], last - q)
        if q == NULL:
            return False
        if memcmp(q - 1, pre, m) == 0:
            return True
        q += 1
    return False


cdef bint _past_prefill(bytes block) noexcept:
    """``motor.coordinator.routing.base.past_prefill`` (the reference) in C: whether the
    block of whole SSE events holds one that is not a keep-alive comment or the chat role
    preamble."""
    cdef const char *p = PyBytes_AS_STRING(block)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(block)
    cdef const char *pre = PyBytes_AS_STRING(_ROLE_PREAMBLE)
    cdef Py_ssize_t m = PyBytes_GET_SIZE(_ROLE_PREAMBLE)
    cdef Py_ssize_t i = 0, j, a, b
    cdef const char *q
    while i < n:
        q = <const char *>memmem(p + i, n - i, b"\n\n", 2)
        j = n if q == NULL else q - p
        a = i
        b = j
        while a < b and _blank(p[a]):
            a += 1
        while b > a and _blank(p[b - 1]):
            b -= 1
        if a < b and p[a] != 58 and not _has_preamble(p + a, b - a, pre, m):   # not ':'
            return True
        i = j + 2
    return False


def past_prefill(bytes block not None):
    """:func:`_past_prefill` for Python (tests compare it with the reference)."""
    return _past_prefill(block)


def last_blank_line(bytes b not None):
    """:func:`_last_blank_line` for tests (equals ``b.rfind(b"\\n\\n")``)."""
    return _last_blank_line(b)


def count(bytes b not None, bytes needle not None):
    """:func:`_count` for tests (equals ``b.count(needle)`` for a non-empty needle)."""
    if not needle:
        raise ValueError("empty needle")
    return _count(b, PyBytes_AS_STRING(needle), PyBytes_GET_SIZE(needle))


@cython.final
cdef class _Pump(ChunkSink):
    """One relay's state and its step for a body piece, taken by the relay's loop or, while
    it waits, by the upstream connection (``ChunkSink.take``)."""
    cdef UpstreamResponse up
    cdef object resp, rec, route, on_first, on_prefill_done, timing, ctx
    cdef double t0
    cdef bint first
    cdef bytes tail
    cdef bint wrote
    cdef double t_tok            # the first event past the prefill (timing only)
    cdef Py_ssize_t n_tok        # data events relayed after it
    cdef object silence          # the Silence of the current quiet spell, or None
    cdef object error            # what a take raised, for the relay to raise
    cdef object drain            # the client's drain a take left to await
    cdef object flush            # a corked answer's flush (Response.cork), or None
    cdef EventScanner sc         # rec's byte scanner, called here (rec.scanning()), or None
    cdef list gen                # ... and the list it appends the token ids to

    cdef int take(self, bytes data) except -1:
        """In ``data_received``: the piece relayed in the relay's context; 1 while the
        client takes data, 0 to wake the relay (a drain to await, an error to raise)."""
        cdef int r = 0
        PyContext_Enter(self.ctx)
        try:
            r = self.piece(data)
        except BaseException as e:
            self.error = e
            r = 0
        if self.flush is not None:      # what this piece wrote goes out now
            try:
                self.flush()
            except BaseException as e:
                if self.error is None:
                    self.error = e
                r = 0
        PyContext_Exit(self.ctx)
        return r

    cdef int piece(self, bytes chunk) except -1:
        """One body piece relayed (the loop body of ``relay_sse_py``): 1 when the client's
        socket takes more now, 0 when :attr:`drain` is to be awaited first."""
        cdef Py_ssize_t cut, n
        self.silence = None
        if PyBytes_GET_SIZE(self.tail):
            chunk = self.tail + chunk
            self.tail = _EMPTY
        cut = _last_blank_line(chunk)
        if cut < 0:
            self.tail = chunk
            if PyBytes_GET_SIZE(chunk) > _MAX_EVENT:
                self.up.close()
                raise _UpstreamClosed(f"SSE event larger than {_MAX_EVENT} bytes "
                                      f"from the engine", before_response=False)
            return 1
        n = PyBytes_GET_SIZE(chunk)
        if cut + 2 < n:
            self.tail = chunk[cut + 2:]
            chunk = chunk[:cut + 2]
        done_now = None     # on_prefill_done, called once this block is written
        if self.t_tok:
            self.n_tok += _count(chunk, b"data:", 5) - _count(chunk, b"[DONE]", 6)
        elif (self.on_prefill_done is not None or self.timing is not None) \
                and _past_prefill(chunk):
            done_now = self.on_prefill_done
            self.on_prefill_done = None
            if self.timing is not None:
                self.t_tok = _perf_counter()
        resp = self.resp
        if self.rec is not None:
            if self.sc is not None:             # rec.feed's scanner branch, without its frame
                fed = self.sc._feed(chunk, self.gen)
                if fed is None:
                    fed = self.rec.unscanned(chunk)
                    self.sc = None              # rec.feed decides for the next blocks
                elif self.sc.news:
                    self.rec.took(self.sc)
            else:
                fed = self.rec.feed(chunk)
            if not fed:
                if done_now is not None:
                    done_now()
                return 1
            resp.write(fed)
        else:
            resp.write(chunk)
        self.wrote = True
        if self.first:
            self.first = False
            ttft = _perf_counter() - self.t0
            self.route.ttft.observe(ttft)
            if self.timing is not None:
                self.timing.ttft.observe(ttft)
            if self.on_first is not None:
                self.on_first()
        if done_now is not None:    # the load's release and the policy's learning
            done_now()              # after the token went out
        d = resp.drain()
        if d is _READY:
            return 1
        self.drain = d
        return 0


async def relay_sse(UpstreamResponse up not None, resp, rec, route, double t0, bint first,
                    idle_timeout_s, on_first=None, on_prefill_done=None, timing=None):
    """``motor.coordinator.routing.base.relay_sse`` (arguments, returns, errors there) for
    a compiled upstream answer."""
    cdef _Pump pump = _Pump.__new__(_Pump)
    cdef bint sink = _READY is not None
    if _Silence is None:
        raise RuntimeError("motor._fast.relay is not bound: import motor.coordinator.routing.base")
    pump.up = up
    pump.resp = resp
    pump.rec = rec
    pump.route = route
    pump.t0 = t0
    pump.first = first
    pump.on_first = on_first
    pump.on_prefill_done = on_prefill_done
    pump.timing = timing
    pump.tail = _EMPTY
    pump.ctx = PyContext_CopyCurrent() if sink else None
    scanning = getattr(rec, "scanning", None) if rec is not None else None
    if scanning is not None:
        sg = scanning()
        if sg is not None:
            pump.sc, pump.gen = sg
    flush = pump.flush = getattr(resp, "flush", None)
    try:
        while True:
            got = up._next_or_wait()
            if got is not None and type(got) is not bytes:
                if flush is not None:
                    flush()
                if sink:
                    up._conn.sink = pump
                try:
                    await got
                except _UpstreamTimeout as e:
                    up._waited()
                    if pump.silence is None:
                        pump.silence = _Silence(idle_timeout_s)
                    pump.silence.waited(e)
                    resp.write(_KEEPALIVE)
                    continue
                except BaseException:
                    up._waited()
                    raise
                up._waited()
                if pump.error is not None:
                    e = pump.error
                    pump.error = None
                    raise e
                if pump.drain is not None:
                    d = pump.drain
                    pump.drain = None
                    await d
                continue
            if got is None:
                break
            if not pump.piece(<bytes>got):
                if flush is not None:
                    flush()
                d = pump.drain
                pump.drain = None
                await d
    except (_UpstreamTimeout, _UpstreamClosed, OSError) as e:
        if flush is not None:
            flush()
        return e, pump.wrote
    if pump.n_tok > 0:
        timing.tpot.observe((_perf_counter() - pump.t_tok) / pump.n_tok)
    if PyBytes_GET_SIZE(pump.tail):
        if rec is not None:
            resp.write(rec.feed(pump.tail + b"\n\n"))
        else:
            resp.write(pump.tail)
        pump.wrote = True
    return None, pump.wrote
