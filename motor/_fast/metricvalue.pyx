# cython: language_level=3
"""Compiled value classes for prometheus-client (its ``values.ValueClass``), installed by
:mod:`motor.coordinator.mpvalues`.

prometheus-client keeps every counter, gauge and histogram bucket of a metric child in a
value object made with ``prometheus_client.values.ValueClass``: in one process a
``MutexValue`` (a float behind a ``threading.Lock``), in multiprocess mode a value written
to a per-process file at every change. The Python of those classes is most of an update's
cost (a frame, the lock taken and released, for files a ``struct`` pack and an ``mmap``
slice assignment).

* :class:`LocalValue`: a float, no lock. An update is one C ``+=`` while the calling
  thread holds the GIL, which no other thread can interleave with, so updates from several
  threads are not lost (what the library's lock is for), on the GIL builds of CPython this
  module is compiled for.
* :class:`MmapValue`: the multiprocess value's float and timestamp, written (16 bytes:
  two native doubles, as ``prometheus_client.mmap_dict`` packs them) at the value's offset
  of its file's *current* mapping at every change. It is a base class:
  :func:`motor.coordinator.mpvalues.fast_value_class` makes the subclass that opens the
  files and places the keys (the library's ``MmapedDict``) and calls :meth:`MmapValue.bind`.
* :class:`BucketCounts`: a histogram child of one process (``LoopHistogramChild`` of
  :mod:`motor.coordinator.metrics` compiled): its bucket counts and sum in C.
* :class:`MmapCount`: a multiprocess gauge child's ``inc()`` / ``dec()`` by one from C
  (its :class:`MmapValue` written), for the in-flight gauges updated on every request.
* :class:`MmapBuckets`: a multiprocess histogram child's ``observe`` compiled: the bucket
  and sum values of a prometheus-client ``Histogram`` child (:class:`MmapValue` each)
  updated from C, the same writes as the child's own ``observe``.
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t
from libc.string cimport memcpy, memset


cdef class BucketCounts:
    """``motor.coordinator.metrics.LoopHistogramChild`` compiled: ``BucketCounts(bounds)``
    (ascending bucket bounds, seconds); :meth:`observe` counts a value in the first bucket
    whose bound is >= it (``bisect_left``; the last count: above every bound) and adds it to
    the sum. ``counts`` (a new list each read) and ``sum`` as the Python class has them.
    Not thread-safe beyond the GIL: one event loop observes."""

    cdef readonly tuple bounds
    cdef double *_bounds
    cdef int64_t *_counts
    cdef Py_ssize_t _n
    cdef public double sum

    def __cinit__(self, tuple bounds not None):
        cdef Py_ssize_t i
        self._n = len(bounds)
        self._bounds = <double *>PyMem_Malloc(max(self._n, 1) * sizeof(double))
        self._counts = <int64_t *>PyMem_Malloc((self._n + 1) * sizeof(int64_t))
        if self._bounds == NULL or self._counts == NULL:
            raise MemoryError()
        for i in range(self._n):
            self._bounds[i] = bounds[i]
        memset(self._counts, 0, (self._n + 1) * sizeof(int64_t))
        self.bounds = bounds
        self.sum = 0.0

    def __dealloc__(self):
        PyMem_Free(self._bounds)
        PyMem_Free(self._counts)

    cpdef observe(self, double amount):
        """Count ``amount`` (seconds) in the first bucket whose bound is >= it."""
        cdef Py_ssize_t i = 0
        while i < self._n and self._bounds[i] < amount:
            i += 1
        self._counts[i] += 1
        self.sum += amount

    @property
    def counts(self):
        """Counts per bucket, the last one above every bound (a new list)."""
        return [self._counts[i] for i in range(self._n + 1)]


cdef class LocalValue:
    """A float of one process (prometheus-client's value interface: ``inc``, ``set``,
    ``get``, ``set_exemplar``, ``get_exemplar``). Made by prometheus-client with the
    metric's type, names, label names and values and help text, all ignored."""

    _multiprocess = False

    cdef double _value
    cdef object _exemplar

    def __init__(self, *args, **kwargs):
        self._value = 0.0
        self._exemplar = None

    def inc(self, double amount):
        self._value += amount

    def set(self, double value, timestamp=None):
        self._value = value

    def set_exemplar(self, exemplar):
        self._exemplar = exemplar

    def get(self):
        return self._value

    def get_exemplar(self):
        return self._exemplar


cdef class MmapValue:
    """A float (and its timestamp) kept in a multiprocess file at ``pos``: the base of
    :func:`motor.coordinator.mpvalues.fast_value_class`'s class, bound by :meth:`bind`
    before its first update."""

    _multiprocess = True

    cdef readonly object _file   # the MmapedDict (read by tests)
    cdef Py_ssize_t _pos
    cdef double _vt[2]      # value, timestamp: the 16 bytes written

    def bind(self, file, Py_ssize_t pos, double value, double timestamp):
        """Write to ``file`` (a ``prometheus_client.mmap_dict.MmapedDict``: its ``_m``
        attribute is the current mapping, replaced when the file grows) at byte offset
        ``pos``, starting from ``value`` and ``timestamp``.

        Raises
        ------
        ValueError
            for a negative or misaligned (not a multiple of 8) ``pos``.
        """
        if pos < 0 or pos % 8:
            raise ValueError(f"pos is expected >= 0 and a multiple of 8, got {pos}")
        self._file = file
        self._pos = pos
        self._vt[0] = value
        self._vt[1] = timestamp

    cdef int _write(self) except -1:
        cdef Py_buffer view
        if self._file is None:
            raise ValueError("the value is not bound to a file (bind)")
        # the file's current mapping (remapped when the file grows), exported only for
        # the copy: a closed mapping raises instead of being written
        m = self._file._m
        if m is None:
            raise ValueError("the value's file is closed")
        PyObject_GetBuffer(m, &view, PyBUF_WRITABLE)
        try:
            if self._pos + 16 > view.len:
                raise ValueError(f"offset {self._pos} past the end of the file's mapping "
                                 f"({view.len} bytes)")
            # both doubles in one copy (as the library's struct.pack_into)
            memcpy(<char *>view.buf + self._pos, self._vt, 16)
        finally:
            PyBuffer_Release(&view)
        return 0

    def inc(self, double amount):
        self._vt[0] += amount
        self._vt[1] = 0.0
        self._write()

    def set(self, double value, timestamp=None):
        self._vt[0] = value
        self._vt[1] = timestamp or 0.0
        self._write()

    def set_exemplar(self, exemplar):
        return   # not kept in multiprocess mode (as in prometheus-client)

    def get(self):
        return self._vt[0]

    def get_exemplar(self):
        return None


cdef class MmapBuckets:
    """``observe`` of a prometheus-client ``Histogram`` child in multiprocess mode, whose
    values are :class:`MmapValue`: ``MmapBuckets(child)`` reads the child's upper bounds
    (``_upper_bounds``, ``+Inf`` last), its bucket values (``_buckets``, one per bound) and
    its sum value (``_sum``). :meth:`observe` does what the library's ``observe`` does
    (prometheus-client 0.26): the sum value plus ``amount``, and the first bucket whose
    bound is >= ``amount`` plus 1 (none for a NaN), each written to its file; without the
    library's Python loop over the bounds, its exemplar argument and its checks (a child
    made by ``labels`` is always observable).

    Raises
    ------
    TypeError
        when a value of ``child`` is not an :class:`MmapValue` (the compiled values are
        not installed), or its bounds and buckets differ in number.
    """

    cdef readonly object child
    cdef double *_bounds
    cdef Py_ssize_t _n
    cdef list _values
    cdef MmapValue _sum

    def __cinit__(self, child not None):
        cdef Py_ssize_t i
        bounds = [float(b) for b in child._upper_bounds]
        values = list(child._buckets)
        if len(bounds) != len(values) or not bounds:
            raise TypeError(f"expected as many buckets as bounds (>= 1), got {len(values)} "
                            f"and {len(bounds)}")
        for v in values + [child._sum]:
            if not isinstance(v, MmapValue):
                raise TypeError(f"expected MmapValue values, got {type(v).__name__}")
        self._n = len(bounds)
        self._bounds = <double *>PyMem_Malloc(self._n * sizeof(double))
        if self._bounds == NULL:
            raise MemoryError()
        for i in range(self._n):
            self._bounds[i] = bounds[i]
        self._values = values
        self._sum = child._sum
        self.child = child

    def __dealloc__(self):
        PyMem_Free(self._bounds)

    cpdef observe(self, double amount):
        """Count ``amount`` in the first bucket whose bound is >= it, add it to the sum."""
        cdef Py_ssize_t i = 0
        cdef MmapValue v = self._sum
        v._vt[0] += amount
        v._vt[1] = 0.0
        v._write()
        while i < self._n:
            if amount <= self._bounds[i]:
                v = <MmapValue>self._values[i]
                v._vt[0] += 1.0
                v._vt[1] = 0.0
                v._write()
                return
            i += 1


cdef class MmapCount:
    """``inc()`` / ``dec()`` by one of a prometheus-client ``Gauge`` child in multiprocess
    mode whose value is an :class:`MmapValue` (``MmapCount(child._value)``): what the
    child's own ``inc()`` / ``dec()`` write, without their Python frames and checks.

    Raises
    ------
    TypeError
        when ``value`` is not an :class:`MmapValue`.
    """

    cdef MmapValue _v

    def __cinit__(self, MmapValue value not None):
        self._v = value

    def inc(self):
        self._v._vt[0] += 1.0
        self._v._vt[1] = 0.0
        self._v._write()

    def dec(self):
        self._v._vt[0] -= 1.0
        self._v._vt[1] = 0.0
        self._v._write()

    def get(self):
        return self._v._vt[0]
