# cython: language_level=3
"""The compiled cells of the multi-worker load table (:mod:`motor.coordinator.loadtable`).

Same layout, same writers and the same generation rules as the pure-Python reference
(:class:`motor.coordinator.loadtable.LoadCell`, used when this module is not built); the
table's module docstring has them. Where the reference does about twenty memoryview item
operations for one request's ``acquire`` + ``release`` (8 k instructions), a compiled cell
does a few word loads and stores.

:class:`Mapping` holds the table's mapping (a buffer export of the ``mmap``) and the
offsets of its ``row_gen`` and ``load`` arrays; every :class:`LoadCell` of the table
reads through it. :meth:`Mapping.release` (the table's ``close``) drops the export: the
cells raise ``ValueError`` from then on, as the reference's released memoryviews do.

Memory ordering: each word is loaded and stored whole (``__atomic`` relaxed loads and
stores of aligned 64-bit words; single writer per cell, so an increment is a load and a
store). A cell's first credit of a generation zeroes its four columns before it stores
the generation (a release store), and readers load a row's generation (an acquire load)
before its columns, so a reader never sums stale columns under a new generation.
"""
from cpython.long cimport PyLong_AsLongLong, PyLong_Check
from libc.stdint cimport int64_t, uint64_t

cdef extern from *:
    """
    #include <stdint.h>
    static inline int64_t motor_ld64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void motor_st64(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    static inline uint64_t motor_ldgen(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void motor_stgen(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    """
    int64_t motor_ld64(const int64_t *p) nogil
    void motor_st64(int64_t *p, int64_t v) nogil
    uint64_t motor_ldgen(const uint64_t *p) nogil
    void motor_stgen(uint64_t *p, uint64_t v) nogil

cdef enum:
    N_LOAD = 4   # load columns per cell: in-flight requests, tokens, prefill, decode tokens


cdef inline int64_t _count(object o) except? -1:
    """An int count as int64 (TypeError for anything else, as the reference's memoryview
    assignment; OverflowError past int64)."""
    if not PyLong_Check(o):
        raise TypeError(f"a load count is expected to be an int, got {type(o).__name__}")
    return PyLong_AsLongLong(o)


cdef class Mapping:
    """A load table's mapping as the compiled cells see it.

    Parameters
    ----------
    buf : writable buffer (the table's ``mmap``)
        The whole segment; kept exported until :meth:`release`.
    n_workers, n_slots : int >= 1
        The table's shape.
    row_gen_off, load_off : int
        Byte offsets of ``row_gen`` (uint64[n_workers, n_slots]) and ``load``
        (int64[n_workers, n_slots, 4]) in ``buf``; 8-byte aligned.

    Raises
    ------
    ValueError
        for a shape below 1, misaligned offsets or arrays past the end of ``buf``.
    BufferError, TypeError
        when ``buf`` is not a writable buffer.
    """

    cdef unsigned char[::1] _view
    cdef uint64_t *_rg
    cdef int64_t *_ld
    cdef readonly Py_ssize_t n_workers
    cdef readonly Py_ssize_t n_slots

    def __init__(self, buf, Py_ssize_t n_workers, Py_ssize_t n_slots,
                 Py_ssize_t row_gen_off, Py_ssize_t load_off):
        cdef unsigned char[::1] view = buf
        if n_workers < 1 or n_slots < 1:
            raise ValueError(f"n_workers and n_slots are expected >= 1, got "
                             f"{n_workers}, {n_slots}")
        if row_gen_off < 0 or load_off < 0 or row_gen_off % 8 or load_off % 8:
            raise ValueError(f"offsets are expected >= 0 and 8-byte aligned, got "
                             f"{row_gen_off}, {load_off}")
        cdef Py_ssize_t cells = n_workers * n_slots
        if (row_gen_off + 8 * cells > view.shape[0]
                or load_off + 8 * N_LOAD * cells > view.shape[0]):
            raise ValueError(f"a table of {n_workers} x {n_slots} at offsets {row_gen_off}, "
                             f"{load_off} does not fit {view.shape[0]} bytes")
        self._view = view
        self.n_workers = n_workers
        self.n_slots = n_slots
        self._rg = <uint64_t *>(&view[0] + row_gen_off)
        self._ld = <int64_t *>(&view[0] + load_off)

    def release(self):
        """Drop the buffer export (the cells raise ``ValueError`` afterwards); idempotent."""
        self._rg = NULL
        self._ld = NULL
        self._view = None

    @property
    def closed(self):
        """Whether :meth:`release` was called."""
        return self._rg == NULL

    cdef int _check(self) except -1:
        if self._rg == NULL:
            raise ValueError("the load table is closed")
        return 0

    cdef tuple _totals(self, Py_ssize_t slot, uint64_t gen):
        cdef int64_t n = 0, t = 0, p = 0, d = 0
        cdef Py_ssize_t w, ri
        cdef int64_t *c
        for w in range(self.n_workers):
            ri = w * self.n_slots + slot
            if motor_ldgen(&self._rg[ri]) == gen:
                c = &self._ld[ri * N_LOAD]
                n += motor_ld64(&c[0])
                t += motor_ld64(&c[1])
                p += motor_ld64(&c[2])
                d += motor_ld64(&c[3])
        return n, t, p, d

    def totals(self, Py_ssize_t slot, uint64_t gen):
        """(in-flight requests, tokens, prefill tokens, decode tokens) of ``slot`` at
        generation ``gen``, summed over the workers whose row counts that generation.

        Raises
        ------
        IndexError
            for a slot outside ``0 .. n_slots - 1``.
        ValueError
            after :meth:`release`.
        """
        self._check()
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range (0 .. {self.n_slots - 1})")
        return self._totals(slot, gen)


cdef class LoadCell:
    """Worker ``worker``'s cell of one endpoint (slot at generation ``gen``): the compiled
    twin of :class:`motor.coordinator.loadtable.LoadCell` (same methods, same effects).

    Parameters
    ----------
    table : motor.coordinator.loadtable.LoadTable
        Its ``_cmap`` (a :class:`Mapping`) is what the cell reads and writes.
    worker, slot : int
        The cell's row and column (``0 <= worker < n_workers``, ``0 <= slot < n_slots``).
    gen : int >= 1
        The slot's generation the cell counts for.

    Raises
    ------
    ValueError
        for a worker, slot or generation out of range.
    TypeError
        when ``table`` has no compiled mapping.
    """

    cdef readonly object table
    cdef readonly Py_ssize_t worker
    cdef readonly Py_ssize_t slot
    cdef readonly uint64_t gen
    cdef Mapping _m
    cdef Py_ssize_t _ri

    def __init__(self, table, Py_ssize_t worker, Py_ssize_t slot, gen):
        cdef Mapping m = table._cmap
        if m is None:
            raise TypeError("the table has no compiled mapping")
        if not 0 <= worker < m.n_workers or not 0 <= slot < m.n_slots or gen < 1:
            raise ValueError(f"load cell out of range: worker {worker} of {m.n_workers}, "
                             f"slot {slot} of {m.n_slots}, generation {gen}")
        self.table = table
        self.worker = worker
        self.slot = slot
        self.gen = gen
        self._m = m
        self._ri = worker * m.n_slots + slot

    def acquire(self, tokens, prefill_tokens, decode_tokens):
        """Count one request (``tokens``: prompt + max_tokens, ``prefill_tokens``,
        ``decode_tokens``, ints); the first credit of this generation starts the cell at 0.

        Raises
        ------
        TypeError
            for a count that is not an int.
        ValueError
            after the table was closed.
        """
        cdef int64_t tok = _count(tokens), pre = _count(prefill_tokens)
        cdef int64_t dec = _count(decode_tokens)
        cdef Mapping m = self._m
        m._check()
        cdef int64_t *c = &m._ld[self._ri * N_LOAD]
        cdef uint64_t *rg = &m._rg[self._ri]
        if motor_ldgen(rg) != self.gen:
            # first credit of this generation here (or the slot was reused): start at 0
            motor_st64(&c[0], 0)
            motor_st64(&c[1], 0)
            motor_st64(&c[2], 0)
            motor_st64(&c[3], 0)
            motor_stgen(rg, self.gen)
        motor_st64(&c[0], motor_ld64(&c[0]) + 1)
        motor_st64(&c[1], motor_ld64(&c[1]) + tok)
        motor_st64(&c[2], motor_ld64(&c[2]) + pre)
        motor_st64(&c[3], motor_ld64(&c[3]) + dec)

    def release(self, tokens, prefill_tokens, decode_tokens):
        """Give back what :meth:`acquire` counted (the prefill tokens still counted); a
        no-op when the row was reset or the slot reused since. Errors as :meth:`acquire`."""
        cdef int64_t tok = _count(tokens), pre = _count(prefill_tokens)
        cdef int64_t dec = _count(decode_tokens)
        cdef Mapping m = self._m
        m._check()
        if motor_ldgen(&m._rg[self._ri]) != self.gen:
            return
        cdef int64_t *c = &m._ld[self._ri * N_LOAD]
        motor_st64(&c[0], motor_ld64(&c[0]) - 1)
        motor_st64(&c[1], motor_ld64(&c[1]) - tok)
        motor_st64(&c[2], motor_ld64(&c[2]) - pre)
        motor_st64(&c[3], motor_ld64(&c[3]) - dec)

    def prefill_done(self, prefill_tokens):
        """A request's prefill finished: its ``prefill_tokens`` (int) leave the prefill
        column (a no-op after a reset or reuse, as in :meth:`release`)."""
        cdef int64_t pre = _count(prefill_tokens)
        cdef Mapping m = self._m
        m._check()
        if motor_ldgen(&m._rg[self._ri]) != self.gen:
            return
        cdef int64_t *c = &m._ld[self._ri * N_LOAD + 2]
        motor_st64(c, motor_ld64(c) - pre)

    def totals(self):
        """(in-flight requests, tokens, prefill tokens, decode tokens) summed over all
        workers (:meth:`Mapping.totals`)."""
        self._m._check()
        return self._m._totals(self.slot, self.gen)

    def mine(self):
        """This worker's own counts (zeros when its row counts another generation)."""
        cdef Mapping m = self._m
        m._check()
        if motor_ldgen(&m._rg[self._ri]) != self.gen:
            return 0, 0, 0, 0
        cdef int64_t *c = &m._ld[self._ri * N_LOAD]
        return motor_ld64(&c[0]), motor_ld64(&c[1]), motor_ld64(&c[2]), motor_ld64(&c[3])

    def __repr__(self):
        return f"<LoadCell worker={self.worker} slot={self.slot} gen={self.gen}>"
