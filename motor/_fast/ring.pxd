# cython: language_level=3
"""Typed layout of ``motor._fast.ring.Ring`` (see ring.pyx, docs/fast.md)."""
from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef enum RecordType:
    RECORD_PAD = 0          # internal: skip to the end of the data area (never returned)
    RECORD_OVERFLOW = 1     # payload: uint64 little-endian count of records dropped
    RECORD_USER = 16        # first type free for callers (push accepts >= RECORD_USER)


cdef enum:
    RING_VERSION = 1
    RING_HEADER_BYTES = 512         # header before the data area
    RING_OFF_MAGIC = 0              # uint64
    RING_OFF_VERSION = 8            # uint32
    RING_OFF_HEADER = 12            # uint32 header size
    RING_OFF_CAPACITY = 16          # uint64 data bytes (power of two)
    RING_OFF_TAIL = 128             # uint64 bytes ever written   (producer, own 128-byte line)
    RING_OFF_HEAD = 256             # uint64 bytes ever consumed  (consumer, own 128-byte line)
    RING_OFF_OVERFLOWS = 384        # uint64 records dropped      (producer)
    RING_RECORD_HEADER = 8          # [u32 payload length][u32 record type]
    RING_ALIGN = 8
    RING_MIN_CAPACITY = 64


cdef class Ring:
    cdef uint8_t *_base             # mmap'd header + data, NULL when closed
    cdef size_t _map_bytes
    cdef uint8_t *_data
    cdef uint64_t _cap
    cdef uint64_t _mask
    cdef uint64_t *_tail            # shared counters inside the mapping
    cdef uint64_t *_head
    cdef uint64_t *_overflows
    cdef uint64_t _head_cache       # producer's last view of head
    cdef uint64_t _tail_cache       # consumer's last view of tail
    cdef uint64_t _pending_drops    # producer: drops not yet announced by a marker
    cdef readonly str name
    cdef readonly bint owner        # created (not attached) by this object
    cdef readonly uint64_t _debug_pads
    cdef readonly uint64_t _debug_checks

    cdef void _bind(self, uint8_t *base, size_t map_bytes, uint64_t cap) noexcept
    cdef int _check_open(self) except -1
    cdef int _push_obj(self, object record_type, object payload, bint count_drop) except -1
    cdef Py_ssize_t _reserve(self, uint64_t *tail, uint64_t total) noexcept nogil
    cdef int _push_raw(self, uint32_t record_type, const uint8_t *payload, uint64_t n,
                       bint count_drop) except -1
    cdef Py_ssize_t _next_record(self, uint64_t *head) except -2
