# cython: language_level=3
"""C-level API of ``motor._fast.hashing`` for other Cython modules."""
from libc.stdint cimport uint32_t, uint64_t

# Hash of one block of ``n`` tokens whose parent hash is ``parent``.
cdef uint64_t hash_block_ptr(uint64_t parent, const uint32_t *tokens, Py_ssize_t n,
                             uint64_t extra) noexcept nogil

# Chained hashes of ``n_blocks`` consecutive blocks of ``block_size`` tokens into out.
cdef void block_hashes_ptr(const uint32_t *tokens, Py_ssize_t n_blocks,
                           Py_ssize_t block_size, uint64_t parent, uint64_t extra,
                           uint64_t *out) noexcept nogil
