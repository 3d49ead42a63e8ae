# cython: language_level=3
"""Declarations of the compiled upstream client's classes (``upstream.pyx``), so other
``motor._fast`` modules (the SSE relay, ``relay.pyx``) call their C methods directly."""
cimport cython


cdef class Pool


cdef class ChunkSink:
    cdef int take(self, bytes data) except -1


@cython.final
cdef class Conn:
    cdef Pool pool
    cdef object transport
    cdef object parser
    cdef readonly object status
    cdef readonly list headers
    cdef list chunks
    cdef Py_ssize_t buffered
    cdef readonly bint headers_done
    cdef readonly bint complete
    cdef readonly object error
    cdef object waiter
    cdef bint paused
    cdef bint got_bytes
    cdef readonly bint closed
    cdef readonly bint keep_alive
    cdef bint counted_out
    cdef bint interim
    cdef bint in_msg
    cdef readonly Py_ssize_t plain_responses
    cdef int ch_state
    cdef Py_ssize_t ch_left
    cdef bytes ch_line
    cdef bint mute_head
    cdef Py_ssize_t ch_mute
    cdef object loop
    cdef double deadline
    cdef object due_phase
    cdef object due_s
    cdef object timer_h
    cdef double timer_at
    cdef ChunkSink sink
    cdef readonly Py_ssize_t pumped
    cdef object owner
    cdef object evicted
    cdef _reset(self)
    cdef _feed(self, data)
    cdef bint _plain_response(self, bytes data)
    cdef _plain_chunks(self, bytes data, Py_ssize_t i)
    cdef _to_httptools(self, bytes data, Py_ssize_t i, bint body, bint after_end=*)
    cdef _body_added(self)
    cdef _pump(self, ChunkSink sink)
    cdef bint _has_length_or_chunked(self)
    cdef inline _wake(self)
    cdef object _waiter(self)
    cdef _arm(self, object timeout_s, str phase)
    cdef inline _disarm(self)
    cdef _stop_timer(self)
    cpdef close(self)
    cpdef bint reusable(self)


@cython.final
cdef class UpstreamResponse:
    cdef Conn _conn
    cdef public object status
    cdef public list headers
    cdef object _idle_timeout_s
    cdef bint _done
    cdef object _step(self)
    cdef object _next_or_wait(self)
    cdef _waited(self)
    cdef _finish(self)


@cython.final
cdef class Pool:
    cdef public object host
    cdef public object port
    cdef public object tls
    cdef public object pool_wait_s
    cdef public object max_idle
    cdef public object max_connections
    cdef public object connect_timeout_s
    cdef list _idle
    cdef Py_ssize_t _open
    cdef object _waiters
    cdef set _conns
    cdef dict _evictable
    cdef bytes _host_header
    cdef public bint closed
    cdef Conn _pop_idle(self)
    cdef _wake_one(self)
    cdef _release(self, Conn c)
    cdef _drop(self, Conn c)
    cdef _forget(self, Conn c)
