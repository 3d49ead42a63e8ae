# cython: language_level=3
"""One request's load on one endpoint, compiled: the same interface and effects as the
pure-Python reference :class:`motor.coordinator.endpoints.Lease` (used when this module is
not built; ``tests/unit/_fast/test_lease.py`` runs both through the same steps).

Constructing a lease counts the request on the endpoint, :meth:`Lease.release` gives it
back, as ``EndpointState.acquire`` / ``release`` do: the endpoint's four counters
(``inflight`` +-1, ``inflight_tokens``, ``inflight_prefill_tokens``,
``inflight_decode_tokens``), then its shared load cell (``shared``: ``acquire`` /
``release`` with the same three figures; workers > 1), its in-flight gauge (``_gauge``:
``inc`` / ``dec``; multiprocess metrics), its breaker (``breaker``: ``on_pick(now)`` when
not closed at the count, ``probe_done()`` when half-open at the give-back) and ``on_free()``
(an instance cap's waiters), each when not ``None``.

The reference costs five Python frames a request (~6.6 k instructions with its release).
Here the endpoint's attributes are ``__slots__`` members read and written at their byte
offsets (:mod:`motor._fast.slots`; the offsets learned once per type, kept while its
version tag is unchanged): generic attribute access from C would cost ~165 instructions an
attribute, more than 3.11's specialized bytecode. An object whose attribute is not a plain
member (another type, a property, a slot left unset) goes through ``getattr`` /
``setattr``, with the same result.
"""
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact, PyLong_FromLongLong
from cpython.object cimport PyTypeObject, Py_TYPE
from cpython.ref cimport PyObject

from motor._fast.slots cimport motor_member_offset, motor_slot, motor_slot_set, motor_type_tag

import time as _time

cdef object _monotonic = _time.monotonic
cdef object _perf_counter = _time.perf_counter

#: the breaker's states (motor.coordinator.breaker: CLOSED, OPEN, HALF_OPEN = 0, 1, 2)
cdef long long CLOSED = 0
cdef long long HALF_OPEN = 2

#: the endpoint attributes a lease reads or writes, in the order of the offsets below
cdef enum:
    A_INFLIGHT = 0
    A_TOKENS = 1
    A_PREFILL = 2
    A_DECODE = 3
    A_SHARED = 4
    A_GAUGE = 5
    A_BREAKER = 6
    A_ON_FREE = 7
    N_ATTRS = 8

cdef tuple _names = ("inflight", "inflight_tokens", "inflight_prefill_tokens",
                     "inflight_decode_tokens", "shared", "_gauge", "breaker", "on_free")
cdef str _STATE = "state"

#: the endpoint type last seen and its version tag (0: none), the attributes' offsets
#: (-1: not a plain member); the breaker type's, for its ``state``
cdef PyTypeObject *_ep_type = NULL
cdef unsigned int _ep_tag = 0
cdef Py_ssize_t _offsets[N_ATTRS]
cdef PyTypeObject *_br_type = NULL
cdef unsigned int _br_tag = 0
cdef Py_ssize_t _state_offset = -1


cdef inline void _learn(object ep) noexcept:
    global _ep_type, _ep_tag
    cdef PyTypeObject *tp = Py_TYPE(ep)
    cdef int i
    if tp == _ep_type and _ep_tag != 0 and motor_type_tag(tp) == _ep_tag:
        return
    _ep_tag = 0
    for i in range(N_ATTRS):
        _offsets[i] = motor_member_offset(tp, _names[i])
    _ep_type = tp
    _ep_tag = motor_type_tag(tp)     # after the lookups, which assign a tag when none


cdef inline object _get(object o, int i):
    """Attribute ``_names[i]`` of endpoint ``o`` (:func:`_learn` called for its type)."""
    cdef Py_ssize_t off = _offsets[i]
    cdef PyObject *p
    if off >= 0:
        p = motor_slot(<PyObject *>o, off)
        if p != NULL:
            return <object>p
    return getattr(o, _names[i])


cdef inline int _add(object o, int i, long long delta) except -1:
    """Add ``delta`` to counter ``_names[i]`` of endpoint ``o``."""
    cdef Py_ssize_t off = _offsets[i]
    cdef PyObject *p
    if off >= 0:
        p = motor_slot(<PyObject *>o, off)
        if p != NULL and PyLong_CheckExact(<object>p):
            v = PyLong_FromLongLong(PyLong_AsLongLong(<object>p) + delta)
            motor_slot_set(<PyObject *>o, off, <PyObject *>v)
            return 0
    setattr(o, _names[i], getattr(o, _names[i]) + delta)
    return 0


cdef long long _state(object br) except? -1:
    """The breaker's ``state`` (an int)."""
    global _br_type, _br_tag, _state_offset
    cdef PyTypeObject *tp = Py_TYPE(br)
    cdef PyObject *p
    if tp != _br_type or _br_tag == 0 or motor_type_tag(tp) != _br_tag:
        _br_tag = 0
        _state_offset = motor_member_offset(tp, _STATE)
        _br_type = tp
        _br_tag = motor_type_tag(tp)
    if _state_offset >= 0:
        p = motor_slot(<PyObject *>br, _state_offset)
        if p != NULL and PyLong_CheckExact(<object>p):
            return PyLong_AsLongLong(<object>p)
    return getattr(br, _STATE)


cdef class Lease:
    """Count one request on ``ep`` until :meth:`release` (exactly once; ``with`` or a
    ``finally``). ``tokens``: prompt + max_tokens; ``prefill_tokens``: the uncached prompt
    tokens still to compute; ``decode_tokens``: max_tokens. :meth:`prefill_done` moves the
    prefill tokens out of the endpoint's in-flight prefill at the first token; :meth:`watch`
    installs the attempt's TTFT callback. The reference's docstring has the rest.

    Raises what the endpoint's attributes and callbacks raise (``AttributeError`` for an
    object that is not an endpoint)."""

    cdef readonly object ep
    cdef readonly long long tokens
    cdef readonly long long prefill_tokens
    cdef readonly long long decode_tokens
    cdef bint _held
    cdef public object watcher
    cdef double _t0

    def __init__(self, ep not None, long long tokens=0, long long prefill_tokens=0,
                 long long decode_tokens=0):
        self.ep = ep
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens
        self.watcher = None
        _learn(ep)
        _add(ep, A_INFLIGHT, 1)
        _add(ep, A_TOKENS, tokens)
        _add(ep, A_PREFILL, prefill_tokens)
        _add(ep, A_DECODE, decode_tokens)
        self._held = True
        sh = _get(ep, A_SHARED)
        if sh is not None:
            sh.acquire(tokens, prefill_tokens, decode_tokens)
        g = _get(ep, A_GAUGE)
        if g is not None:
            g.inc()
        br = _get(ep, A_BREAKER)
        if _state(br) != CLOSED:
            br.on_pick(_monotonic())

    def watch(self, cb):
        """Call ``cb(ttft_s)`` at the first token (:meth:`prefill_done`) or whole answer
        (:meth:`answered`), timed from now; None: nothing to call."""
        if cb is not None:
            self.watcher = cb
            self._t0 = _perf_counter()

    def answered(self):
        """A whole (non-streamed) answer came: its time is the attempt's TTFT."""
        cb = self.watcher
        if cb is not None:
            self.watcher = None
            cb(_perf_counter() - self._t0)

    def prefill_done(self):
        """The engine sent this request's first token (its prefill is over)."""
        if self.watcher is not None:
            self.answered()
        if self._held and self.prefill_tokens:
            self.ep.prefill_done(self.prefill_tokens)
            self.prefill_tokens = 0

    def release(self):
        """Give the load back (once; later calls do nothing)."""
        if not self._held:
            return
        self._held = False
        self.watcher = None
        ep = self.ep
        _learn(ep)
        _add(ep, A_INFLIGHT, -1)
        _add(ep, A_TOKENS, -self.tokens)
        _add(ep, A_PREFILL, -self.prefill_tokens)
        _add(ep, A_DECODE, -self.decode_tokens)
        sh = _get(ep, A_SHARED)
        if sh is not None:
            sh.release(self.tokens, self.prefill_tokens, self.decode_tokens)
        g = _get(ep, A_GAUGE)
        if g is not None:
            g.dec()
        br = _get(ep, A_BREAKER)
        if _state(br) == HALF_OPEN:
            br.probe_done()
        cb = _get(ep, A_ON_FREE)
        if cb is not None:
            cb()

    @property
    def held(self):
        """Whether the load is still counted (not released)."""
        return self._held

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
