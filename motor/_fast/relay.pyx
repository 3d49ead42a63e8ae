# cython: language_level=3
"""The SSE relay of one stream leg, compiled.

:func:`relay_sse` is ``motor.coordinator.routing.base.relay_sse`` (the reference, which
says what it does and is used with the pure-Python client) over the compiled client's
:class:`~motor._fast.upstream.UpstreamResponse`: the same writes to the client, the same
returns and errors, the same observations, in the same order. What differs is the cost per
event: the loop is C; the next body piece is taken with the response's C method and its
future awaited here (no ``next_chunk`` coroutine per event); the client's ``drain`` is
awaited as the server's response returns it (no coroutine while the socket takes data).

This module imports nothing from ``motor``: ``motor.coordinator.routing.base`` hands it,
once, with :func:`bind`, the client's exception classes, its ``Silence`` counter, its
``past_prefill`` test, the keep-alive comment and the largest event it relays.
"""
cimport cython
from cpython.bytes cimport PyBytes_GET_SIZE

from motor._fast.upstream cimport UpstreamResponse

import time

cdef object _perf_counter = time.perf_counter

# bound once by motor.coordinator.routing.base (bind)
cdef object _UpstreamTimeout = None
cdef object _UpstreamClosed = None
cdef object _Silence = None
cdef object _past_prefill = None
cdef bytes _KEEPALIVE = b""
cdef Py_ssize_t _MAX_EVENT = 0
cdef bytes _EMPTY = b""


def bind(upstream_timeout not None, upstream_closed not None, silence not None,
         past_prefill not None, bytes keepalive not None, Py_ssize_t max_event_bytes):
    """Give the relay what it takes from ``motor``: ``UpstreamTimeout`` and
    ``UpstreamClosed`` (the classes the client raises), ``Silence(idle_timeout_s)`` (with
    ``waited(e)``), ``past_prefill(block) -> bool``, the keep-alive comment (bytes) and the
    largest SSE event relayed (bytes). Called once at import of the reference's module;
    again replaces them."""
    global _UpstreamTimeout, _UpstreamClosed, _Silence, _past_prefill, _KEEPALIVE, _MAX_EVENT
    _UpstreamTimeout = upstream_timeout
    _UpstreamClosed = upstream_closed
    _Silence = silence
    _past_prefill = past_prefill
    _KEEPALIVE = keepalive
    _MAX_EVENT = max_event_bytes


def bound():
    """True once :func:`bind` was called."""
    return _Silence is not None


async def relay_sse(UpstreamResponse up not None, resp, rec, route, double t0, bint first,
                    idle_timeout_s, on_first=None, on_prefill_done=None, timing=None):
    """``motor.coordinator.routing.base.relay_sse`` (arguments, returns, errors there) for
    a compiled upstream answer."""
    cdef bytes tail = _EMPTY
    cdef bytes chunk
    cdef bint wrote = False
    cdef double t_tok = 0.0      # the first event past the prefill (timing only)
    cdef Py_ssize_t n_tok = 0    # data events relayed after it
    cdef Py_ssize_t cut, n
    silence = None
    if _Silence is None:
        raise RuntimeError("motor._fast.relay is not bound: import motor.coordinator.routing.base")
    try:
        while True:
            got = up._next_or_wait()
            if got is not None and type(got) is not bytes:
                try:
                    await got
                except _UpstreamTimeout as e:
                    up._waited()
                    if silence is None:
                        silence = _Silence(idle_timeout_s)
                    silence.waited(e)
                    resp.write(_KEEPALIVE)
                    continue
                except BaseException:
                    up._waited()
                    raise
                up._waited()
                continue
            if got is None:
                break
            chunk = <bytes>got
            silence = None
            if PyBytes_GET_SIZE(tail):
                chunk = tail + chunk
                tail = _EMPTY
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                tail = chunk
                if PyBytes_GET_SIZE(tail) > _MAX_EVENT:
                    up.close()
                    raise _UpstreamClosed(f"SSE event larger than {_MAX_EVENT} bytes "
                                          f"from the engine", before_response=False)
                continue
            n = PyBytes_GET_SIZE(chunk)
            if cut + 2 < n:
                tail = chunk[cut + 2:]
                chunk = chunk[:cut + 2]
            done_now = None     # on_prefill_done, called once this block is written
            if t_tok:
                n_tok += chunk.count(b"data:") - chunk.count(b"[DONE]")
            elif (on_prefill_done is not None or timing is not None) and _past_prefill(chunk):
                done_now = on_prefill_done
                on_prefill_done = None
                if timing is not None:
                    t_tok = _perf_counter()
            if rec is not None:
                fed = rec.feed(chunk)
                if not fed:
                    if done_now is not None:
                        done_now()
                    continue
                resp.write(fed)
            else:
                resp.write(chunk)
            wrote = True
            if first:
                first = False
                ttft = _perf_counter() - t0
                route.ttft.observe(ttft)
                if timing is not None:
                    timing.ttft.observe(ttft)
                if on_first is not None:
                    on_first()
            if done_now is not None:    # the load's release and the policy's learning
                done_now()              # after the token went out
            await resp.drain()
    except (_UpstreamTimeout, _UpstreamClosed, OSError) as e:
        return e, wrote
    if n_tok > 0:
        timing.tpot.observe((_perf_counter() - t_tok) / n_tok)
    if PyBytes_GET_SIZE(tail):
        if rec is not None:
            resp.write(rec.feed(tail + b"\n\n"))
        else:
            resp.write(tail)
        wrote = True
    return None, wrote
