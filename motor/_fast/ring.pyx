# cython: language_level=3
"""Single-producer single-consumer ring of framed byte records in POSIX shared memory.

Layout of the shared segment (``/dev/shm/<name>``, the same namespace as
``multiprocessing.shared_memory``)::

    0    magic u64 "MOTORRNG", version u32, header bytes u32, capacity u64
    128  tail u64: bytes ever written        (producer writes; own 128-byte line)
    256  head u64: bytes ever consumed       (consumer writes; own 128-byte line)
    384  overflows u64: records dropped      (producer writes)
    512  data area, ``capacity`` bytes (a power of two)

A record is ``[u32 payload length][u32 record type][payload][zero pad to 8]``
(little-endian fields on little-endian hosts; native order in general). A record
never wraps: when it does not fit before the end of the data area, a
``RECORD_PAD`` record fills the rest and the record starts at offset 0.
``head`` and ``tail`` only grow (mod 2**64); ``tail - head`` is the bytes in use.

Memory ordering (C11 / GCC ``__atomic``): the producer writes the record bytes,
then stores ``tail`` with release; the consumer loads ``tail`` with acquire
before reading records, and stores ``head`` with release after copying them
out; the producer loads ``head`` with acquire before reusing space. That is
correct on x86-64 (TSO) and on aarch64 / other weakly ordered CPUs. No locks.

Full ring: :meth:`Ring.push` returns False, counts the record as dropped in the
shared ``overflows`` counter, and the next record that fits is preceded by a
``RECORD_OVERFLOW`` record (payload: uint64 number of records dropped since the
previous marker), so the consumer sees exactly where the gap is and can resync.
:meth:`Ring.try_push` / :meth:`Ring.push_many` return False / a short count
instead and drop nothing (backpressure). Nothing is ever overwritten.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcpy, memset, strerror
from libc.errno cimport errno
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New
from cpython.ref cimport Py_INCREF

from motor._fast._common cimport MOTOR_DEBUG, mf_likely, mf_unlikely

cdef extern from *:
    """
    #include <stdint.h>
    #include <fcntl.h>
    #include <sys/mman.h>
    #include <sys/stat.h>
    #include <unistd.h>
    #define RING_MAGIC 0x474E5252524F544DULL  /* "MTORRRNG" little-endian bytes */
    static inline uint64_t ring_load_acquire(const uint64_t *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline uint64_t ring_load_relaxed(const uint64_t *p) {
        return __atomic_load_n(p, __ATOMIC_RELAXED);
    }
    static inline void ring_store_release(uint64_t *p, uint64_t v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    static inline void ring_write_header(uint8_t *at, uint32_t len, uint32_t type) {
        memcpy(at, &len, 4);
        memcpy(at + 4, &type, 4);
    }
    static inline void ring_read_header(const uint8_t *at, uint32_t *len, uint32_t *type) {
        memcpy(len, at, 4);
        memcpy(type, at + 4, 4);
    }
    static inline uint64_t ring_total(uint64_t payload) {
        return 8 + ((payload + 7) & ~(uint64_t)7);
    }
    static void *ring_mmap(int fd, size_t n) {
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    """
    const uint64_t RING_MAGIC
    uint64_t ring_load_acquire(const uint64_t *p) nogil
    uint64_t ring_load_relaxed(const uint64_t *p) nogil
    void ring_store_release(uint64_t *p, uint64_t v) nogil
    void ring_write_header(uint8_t *at, uint32_t length, uint32_t rtype) nogil
    void ring_read_header(const uint8_t *at, uint32_t *length, uint32_t *rtype) nogil
    uint64_t ring_total(uint64_t payload) nogil
    void *ring_mmap(int fd, size_t n) nogil
    int O_CREAT, O_EXCL, O_RDWR
    int shm_open(const char *name, int oflag, int mode) nogil
    int shm_unlink(const char *name) nogil
    int ftruncate(int fd, int64_t length) nogil
    int close(int fd) nogil
    int munmap(void *addr, size_t length) nogil
    struct stat:
        int64_t st_size
    int fstat(int fd, stat *buf) nogil

#: True when compiled with ``-DMOTOR_DEBUG=1``.
DEBUG = bool(MOTOR_DEBUG)
globals().update({"RECORD_PAD": <int>RECORD_PAD, "RECORD_OVERFLOW": <int>RECORD_OVERFLOW,
                  "RECORD_USER": <int>RECORD_USER, "HEADER_BYTES": <int>RING_HEADER_BYTES})
#: Largest record type accepted by push.
RECORD_TYPE_MAX = 0xFFFFFFFF


cdef bytes _shm_path(str name):
    if not name or "/" in name[1:] or len(name) > 250:
        raise ValueError(f"name is expected to be a shared-memory name without '/', "
                         f"got {name!r}")
    return (name if name.startswith("/") else "/" + name).encode()


cdef object _os_error(str name):
    cdef int e = errno
    return OSError(e, strerror(e).decode("utf-8", "replace"), name)


cdef class Ring:
    """SPSC ring of framed records in shared memory (see the module docstring).

    Build with :meth:`create` (owner, once) and :meth:`attach` (any process).
    One process pushes, one pops; the object is not thread-safe beyond the GIL.
    Use as a context manager to :meth:`close` the mapping.
    """

    def __cinit__(self):
        self._base = NULL
        self._data = NULL
        self._map_bytes = 0
        self.name = ""
        self.owner = False

    def __init__(self, *args, **kwargs):
        raise TypeError("Ring is built with Ring.create(name, capacity_bytes) or "
                        "Ring.attach(name)")

    def __dealloc__(self):
        if self._base != NULL:
            munmap(self._base, self._map_bytes)
            self._base = NULL

    cdef void _bind(self, uint8_t *base, size_t map_bytes, uint64_t cap) noexcept:
        self._base = base
        self._map_bytes = map_bytes
        self._data = base + RING_HEADER_BYTES
        self._cap = cap
        self._mask = cap - 1
        self._tail = <uint64_t *>(base + RING_OFF_TAIL)
        self._head = <uint64_t *>(base + RING_OFF_HEAD)
        self._overflows = <uint64_t *>(base + RING_OFF_OVERFLOWS)
        self._head_cache = ring_load_acquire(self._head)
        self._tail_cache = ring_load_acquire(self._tail)
        self._pending_drops = 0

    @staticmethod
    def create(str name, Py_ssize_t capacity_bytes):
        """Create the shared segment ``name`` with a data area of ``capacity_bytes``.

        Parameters
        ----------
        name : str
            Shared-memory name (no '/' after an optional leading one).
        capacity_bytes : int
            Data area size in bytes, a power of two >= 64. The largest record is
            ``capacity_bytes // 2`` bytes including its 8-byte header.

        Returns
        -------
        Ring
            The owner's handle (``owner`` is True).

        Raises
        ------
        ValueError
            Bad name or capacity.
        FileExistsError
            A segment with that name exists.
        OSError
            Other shm_open / ftruncate / mmap failures.
        """
        cdef bytes path = _shm_path(name)
        cdef int fd
        cdef size_t n
        cdef uint8_t *base
        cdef Ring r
        if (capacity_bytes < RING_MIN_CAPACITY or capacity_bytes > (<Py_ssize_t>1 << 40)
                or (capacity_bytes & (capacity_bytes - 1)) != 0):
            raise ValueError(f"capacity_bytes is expected to be a power of two in "
                             f"64..2**40, got {capacity_bytes}")
        n = RING_HEADER_BYTES + <size_t>capacity_bytes
        fd = shm_open(path, O_CREAT | O_EXCL | O_RDWR, 0o600)
        if fd < 0:
            raise _os_error(name)
        if ftruncate(fd, <int64_t>n) != 0:
            err = _os_error(name)
            close(fd)
            shm_unlink(path)
            raise err
        base = <uint8_t *>ring_mmap(fd, n)
        if base == NULL:
            err = _os_error(name)
            close(fd)
            shm_unlink(path)
            raise err
        close(fd)
        memset(base, 0, RING_HEADER_BYTES)
        (<uint32_t *>(base + RING_OFF_VERSION))[0] = RING_VERSION
        (<uint32_t *>(base + RING_OFF_HEADER))[0] = RING_HEADER_BYTES
        (<uint64_t *>(base + RING_OFF_CAPACITY))[0] = <uint64_t>capacity_bytes
        ring_store_release(<uint64_t *>(base + RING_OFF_MAGIC), RING_MAGIC)
        r = Ring.__new__(Ring)
        r._bind(base, n, <uint64_t>capacity_bytes)
        r.name = name
        r.owner = True
        return r

    @staticmethod
    def attach(str name):
        """Map an existing ring created by :meth:`create` (any process).

        Raises
        ------
        FileNotFoundError
            No segment with that name.
        ValueError
            The segment is not a motor ring of this version, or is truncated.
        OSError
            Other shm_open / fstat / mmap failures.
        """
        cdef bytes path = _shm_path(name)
        cdef int fd
        cdef stat st
        cdef size_t n
        cdef uint8_t *base
        cdef uint64_t cap
        cdef Ring r
        fd = shm_open(path, O_RDWR, 0)
        if fd < 0:
            raise _os_error(name)
        if fstat(fd, &st) != 0:
            err = _os_error(name)
            close(fd)
            raise err
        if st.st_size < RING_HEADER_BYTES + RING_MIN_CAPACITY:
            close(fd)
            raise ValueError(f"shared memory {name!r} is not a motor ring "
                             f"({st.st_size} bytes)")
        n = <size_t>st.st_size
        base = <uint8_t *>ring_mmap(fd, n)
        if base == NULL:
            err = _os_error(name)
            close(fd)
            raise err
        close(fd)
        cap = (<uint64_t *>(base + RING_OFF_CAPACITY))[0]
        if (ring_load_acquire(<uint64_t *>(base + RING_OFF_MAGIC)) != RING_MAGIC
                or (<uint32_t *>(base + RING_OFF_VERSION))[0] != RING_VERSION
                or (<uint32_t *>(base + RING_OFF_HEADER))[0] != RING_HEADER_BYTES
                or cap + RING_HEADER_BYTES != n or (cap & (cap - 1)) != 0):
            munmap(base, n)
            raise ValueError(f"shared memory {name!r} is not a motor ring of version "
                             f"{RING_VERSION} (bad magic, version or size)")
        r = Ring.__new__(Ring)
        r._bind(base, n, cap)
        r.name = name
        r.owner = False
        return r

    def close(self):
        """Unmap this process's view (idempotent). The segment stays until unlink."""
        if self._base != NULL:
            munmap(self._base, self._map_bytes)
            self._base = NULL
            self._data = NULL

    def unlink(self):
        """Remove the segment name (existing mappings stay valid until closed).

        Raises
        ------
        FileNotFoundError
            Already unlinked.
        """
        if shm_unlink(_shm_path(self.name)) != 0:
            raise _os_error(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    cdef int _check_open(self) except -1:
        if mf_unlikely(self._base == NULL):
            raise ValueError(f"ring {self.name!r} is closed")
        return 0

    # ------------------------------------------------------------ producer

    cdef Py_ssize_t _reserve(self, uint64_t *tail, uint64_t total) noexcept nogil:
        """Make room for a ``total``-byte record at ``tail[0]`` (adding a pad record
        when it would wrap); return its data offset and advance ``tail[0]``, or -1
        when the ring is full. Nothing is published."""
        cdef uint64_t t = tail[0]
        cdef uint64_t off = t & self._mask
        cdef uint64_t contiguous = self._cap - off
        cdef uint64_t need = total if total <= contiguous else contiguous + total
        if t + need - self._head_cache > self._cap:
            self._head_cache = ring_load_acquire(self._head)
            if t + need - self._head_cache > self._cap:
                return -1
        if total > contiguous:
            ring_write_header(self._data + off, <uint32_t>(contiguous - RING_RECORD_HEADER),
                              RECORD_PAD)
            t += contiguous
            off = 0
            self._debug_pads += 1
        tail[0] = t + total
        return <Py_ssize_t>off

    cdef int _push_raw(self, uint32_t record_type, const uint8_t *payload, uint64_t n,
                       bint count_drop) except -1:
        """Returns 1 when pushed, 0 when full (counted as a drop if count_drop)."""
        cdef uint64_t total = ring_total(n)
        cdef uint64_t t0, t
        cdef Py_ssize_t moff = -1, off
        if mf_unlikely(total > self._cap // 2):
            raise ValueError(f"payload is expected to be <= {self._cap // 2 - 8} bytes "
                             f"(half the ring minus the header), got {n}")
        t0 = ring_load_relaxed(self._tail)
        t = t0
        if mf_unlikely(self._pending_drops != 0):
            moff = self._reserve(&t, RING_RECORD_HEADER + 8)
            if moff < 0:
                t = t0
        off = -1 if (self._pending_drops != 0 and moff < 0) else self._reserve(&t, total)
        if off < 0:
            if count_drop:
                self._pending_drops += 1
                ring_store_release(self._overflows, ring_load_relaxed(self._overflows) + 1)
            return 0
        if moff >= 0:
            ring_write_header(self._data + moff, 8, RECORD_OVERFLOW)
            memcpy(self._data + moff + RING_RECORD_HEADER, &self._pending_drops, 8)
            self._pending_drops = 0
        ring_write_header(self._data + off, <uint32_t>n, record_type)
        if n:
            memcpy(self._data + off + RING_RECORD_HEADER, payload, n)
        if total - RING_RECORD_HEADER > n:
            memset(self._data + off + RING_RECORD_HEADER + n, 0,
                   total - RING_RECORD_HEADER - n)
        if MOTOR_DEBUG:
            self._debug_checks += 1
            if t - ring_load_acquire(self._head) > self._cap:
                raise AssertionError(f"ring {self.name!r}: tail - head exceeds capacity")
        ring_store_release(self._tail, t)
        return 1

    cdef int _push_obj(self, object record_type, object payload, bint count_drop) except -1:
        cdef Py_buffer view
        cdef uint64_t rt = record_type
        cdef int res
        if rt < RECORD_USER or rt > 0xFFFFFFFFULL:
            raise ValueError(f"record_type is expected to be in {RECORD_USER}..2**32-1, "
                             f"got {record_type}")
        if type(payload) is bytes:
            return self._push_raw(<uint32_t>rt, <const uint8_t *>PyBytes_AS_STRING(payload),
                                  <uint64_t>PyBytes_GET_SIZE(payload), count_drop)
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            res = self._push_raw(<uint32_t>rt, <const uint8_t *>view.buf, <uint64_t>view.len,
                                 count_drop)
        finally:
            PyBuffer_Release(&view)
        return res

    def push(self, record_type, payload):
        """Append one record; drop it (and report) when the ring is full.

        Parameters
        ----------
        record_type : int
            RECORD_USER (16) .. 2**32-1.
        payload : bytes-like (contiguous)
            At most ``capacity // 2 - 8`` bytes.

        Returns
        -------
        bool
            True when written. False when full: the record is dropped, counted in
            :attr:`overflows`, and a RECORD_OVERFLOW marker precedes the next record.

        Raises
        ------
        ValueError
            Closed ring, reserved / out-of-range record type, oversized payload.
        TypeError
            ``payload`` is not a contiguous buffer.
        """
        self._check_open()
        return self._push_obj(record_type, payload, True) == 1

    def try_push(self, record_type, payload):
        """Like :meth:`push`, but a full ring drops nothing: returns False and the
        producer keeps the record (backpressure)."""
        self._check_open()
        return self._push_obj(record_type, payload, False) == 1

    def push_many(self, record_type, payloads):
        """Append records of one type from a sequence, in order, until one does not
        fit (nothing dropped).

        Returns
        -------
        int
            How many leading items of ``payloads`` were written.
        """
        cdef Py_ssize_t i = 0
        self._check_open()
        for payload in payloads:
            if self._push_obj(record_type, payload, False) != 1:
                break
            i += 1
        return i

    # ------------------------------------------------------------ consumer

    cdef Py_ssize_t _next_record(self, uint64_t *head) except -2:
        """Offset of the next record at ``head[0]`` (skipping pad records, which
        advances ``head[0]``), or -1 when empty. Checks the framing against the
        published bytes and raises RuntimeError on a corrupt ring."""
        cdef uint64_t h = head[0], avail, off, total
        cdef uint32_t length, rtype
        while True:
            if h == self._tail_cache:
                self._tail_cache = ring_load_acquire(self._tail)
                if h == self._tail_cache:
                    head[0] = h
                    return -1
            avail = self._tail_cache - h
            off = h & self._mask
            if mf_unlikely(avail > self._cap or avail < RING_RECORD_HEADER):
                raise RuntimeError(f"ring {self.name!r} is corrupt: {avail} bytes "
                                   f"published at head {h}")
            ring_read_header(self._data + off, &length, &rtype)
            if rtype == RECORD_PAD:
                if mf_unlikely(off + RING_RECORD_HEADER + length != self._cap):
                    raise RuntimeError(f"ring {self.name!r} is corrupt: pad record of "
                                       f"{length} bytes at offset {off}")
                h += RING_RECORD_HEADER + length
                continue
            total = ring_total(length)
            if mf_unlikely(total > avail or off + total > self._cap):
                raise RuntimeError(f"ring {self.name!r} is corrupt: record of {length} "
                                   f"bytes at offset {off}, {avail} bytes published")
            head[0] = h
            return <Py_ssize_t>off

    def pop(self):
        """Remove and return the oldest record.

        Returns
        -------
        (int, bytes) or None
            ``(record_type, payload)``, None when empty. ``record_type`` may be
            RECORD_OVERFLOW (payload: uint64 LE count of dropped records).

        Raises
        ------
        ValueError
            Closed ring.
        RuntimeError
            The framing is corrupt (never expected; means a bug or a second producer).
        """
        cdef uint64_t h
        cdef Py_ssize_t off
        cdef uint32_t length, rtype
        self._check_open()
        h = ring_load_relaxed(self._head)
        off = self._next_record(&h)
        if off < 0:
            return None
        ring_read_header(self._data + off, &length, &rtype)
        payload = PyBytes_FromStringAndSize(<char *>(self._data + off + RING_RECORD_HEADER),
                                            length)
        ring_store_release(self._head, h + ring_total(length))
        return rtype, payload

    def peek(self):
        """The oldest record without removing it: ``(record_type, bytes)`` or None."""
        cdef uint64_t h
        cdef Py_ssize_t off
        cdef uint32_t length, rtype
        self._check_open()
        h = ring_load_relaxed(self._head)
        off = self._next_record(&h)
        if off < 0:
            return None
        ring_read_header(self._data + off, &length, &rtype)
        return rtype, PyBytes_FromStringAndSize(
            <char *>(self._data + off + RING_RECORD_HEADER), length)

    def pop_into(self, buffer):
        """Copy the oldest record's payload into ``buffer`` and remove it.

        Returns
        -------
        (int, int) or None
            ``(record_type, payload_bytes)``, None when empty.

        Raises
        ------
        ValueError
            ``buffer`` is smaller than the payload (the record stays in the ring).
        TypeError
            ``buffer`` is not a writable contiguous buffer.
        """
        cdef Py_buffer view
        cdef uint64_t h
        cdef Py_ssize_t off
        cdef uint32_t length, rtype
        self._check_open()
        PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            h = ring_load_relaxed(self._head)
            off = self._next_record(&h)
            if off < 0:
                return None
            ring_read_header(self._data + off, &length, &rtype)
            if <Py_ssize_t>length > view.len:
                raise ValueError(f"buffer is expected to hold >= {length} bytes, "
                                 f"got {view.len}")
            memcpy(view.buf, self._data + off + RING_RECORD_HEADER, length)
            ring_store_release(self._head, h + ring_total(length))
        finally:
            PyBuffer_Release(&view)
        return rtype, length

    def pop_many(self, Py_ssize_t max_records=1024):
        """Remove up to ``max_records`` records; returns a list of
        ``(record_type, bytes)`` (empty when the ring is empty). ``head`` is
        published every 256 records and at the end."""
        cdef uint64_t h
        cdef Py_ssize_t off, i = 0
        cdef uint32_t length, rtype
        cdef list out = []
        self._check_open()
        h = ring_load_relaxed(self._head)
        while i < max_records:
            off = self._next_record(&h)
            if off < 0:
                break
            ring_read_header(self._data + off, &length, &rtype)
            out.append((rtype, PyBytes_FromStringAndSize(
                <char *>(self._data + off + RING_RECORD_HEADER), length)))
            h += ring_total(length)
            i += 1
            if (i & 255) == 0:
                ring_store_release(self._head, h)
        ring_store_release(self._head, h)
        return out

    # ------------------------------------------------------------ state

    @property
    def capacity(self):
        """Data area size in bytes."""
        return self._cap

    @property
    def closed(self):
        return self._base == NULL

    @property
    def used_bytes(self):
        """Bytes written and not yet consumed (a snapshot)."""
        self._check_open()
        return ring_load_acquire(self._tail) - ring_load_acquire(self._head)

    @property
    def free_bytes(self):
        """``capacity - used_bytes`` (a snapshot; a record needs 8 + payload rounded
        up to 8 bytes, plus a pad when it would wrap)."""
        self._check_open()
        return self._cap - (ring_load_acquire(self._tail) - ring_load_acquire(self._head))

    @property
    def overflows(self):
        """Records dropped by :meth:`push` since creation (shared; both sides see it)."""
        self._check_open()
        return ring_load_acquire(self._overflows)

    @property
    def pending_drops(self):
        """Producer side: drops not yet announced by a RECORD_OVERFLOW marker."""
        return self._pending_drops

    @property
    def head(self):
        """Bytes ever consumed (shared counter)."""
        self._check_open()
        return ring_load_acquire(self._head)

    @property
    def tail(self):
        """Bytes ever written (shared counter)."""
        self._check_open()
        return ring_load_acquire(self._tail)
