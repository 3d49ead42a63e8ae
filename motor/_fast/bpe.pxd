from libc.stdint cimport int32_t, uint32_t, uint64_t


cdef struct BpePair:
    uint64_t key            # (left id << 32) | right id
    uint32_t rank1          # the merge's rank + 1; 0: an empty slot
    uint32_t new_id


cdef class ByteLevelBpe:
    cdef BpePair *table     # open addressing, linear probing
    cdef uint64_t mask
    cdef int32_t byte_id[128]   # an ASCII byte's token (its alphabet character's), -1: none
    cdef dict vocab
    cdef bint ignore_merges
    cdef readonly Py_ssize_t n_merges
    cdef void _put(self, uint64_t key, uint32_t rank, uint32_t new_id) noexcept
    cdef uint32_t _rank(self, int32_t a, int32_t b, int32_t *new_id) noexcept nogil
    cdef object encode_ascii(self, str word)
