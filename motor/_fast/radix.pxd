# cython: language_level=3
"""Typed layout of ``motor._fast.radix.PrefixIndex`` (see radix.pyx, docs/fast.md)."""
from libc.stdint cimport uint32_t, uint64_t, int32_t, int64_t


cdef enum Tier:
    TIER_DEVICE = 0   # accelerator memory (HBM)
    TIER_HOST = 1     # host DRAM (CPU offload)
    TIER_DISK = 2     # local disk / remote store


cdef enum:
    N_TIERS = 3
    # Layout: per node, per 64-instance word w, four masks [any, device, host, disk].
    RADIX_MASKS_PER_WORD = 4
    RADIX_MAX_WORDS = 4            # max_instances <= 256
    RADIX_MAX_INSTANCES = 256
    RADIX_INITIAL_NODES = 1024     # node capacity at construction and shrink floor
    # The hash table is RADIX_TABLES sub-tables, chosen by the top RADIX_TABLE_BITS bits of the
    # mixed hash, each grown (load > 1/2) and shrunk (load < 1/8) on its own: a resize moves
    # 1/256 of the keys, never the whole table.
    RADIX_TABLE_BITS = 8
    RADIX_TABLES = 256
    RADIX_TABLE_MIN = 16           # slots of a sub-table, at least
    RADIX_PREFETCH_SLOTS = 32      # match: blocks ahead whose table slot is prefetched
    RADIX_PREFETCH_NODES = 16       # match: blocks ahead whose node masks are prefetched
    RADIX_STORE_AHEAD = 32         # store, remove: blocks looked up before their nodes change
    RADIX_SHRINK_BUDGET = 65536    # work units of one step of halving the pool (~0.1 ms)
    RADIX_SHRINK_MOVE = 64         # units of moving one node (an id looked at: 1)
    RADIX_SHRINK_RELEASE = 8       # units of giving one node's memory back
    RADIX_POP_FILTER = 64          # free ids a pop may filter while the pool halves


cdef struct RadixSlot:
    uint64_t key     # block hash, 0 = empty slot
    uint32_t node    # node id
    uint32_t _pad


cdef struct RadixTable:
    RadixSlot *slots
    uint64_t mask    # slots - 1 (a power of two)
    uint32_t count   # keys held
    int shift        # 64 - log2(slots): home slot = (mixed hash << RADIX_TABLE_BITS) >> shift
    uint64_t _pad    # 32 bytes: two sub-tables a cache line, none across two


cdef class PrefixIndex:
    cdef readonly int max_instances
    cdef int _nwords                 # 64-instance words per mask
    cdef int _stride                 # uint64 words per node in _bits (4 * _nwords)
    cdef uint64_t _last_word_mask    # valid instances in the last word
    cdef int _used_words             # words up to the highest instance ever stored (match reads these)

    # open-addressing sub-tables (linear probing, backward-shift delete)
    cdef RadixTable *_tabs

    # node pool (struct of arrays, ids 0.._node_cap-1; grown in place, ids kept)
    cdef uint32_t _node_cap
    cdef uint32_t _fresh             # ids >= _fresh were never used (their memory is zero)
    cdef uint64_t *_keys             # 0 = free node
    cdef uint64_t *_bits             # _stride words per node
    cdef double *_ts                 # last store time (clamped non-decreasing)
    cdef uint32_t *_prev             # LRU list (head = oldest); free list via _next
    cdef uint32_t *_next
    cdef uint32_t *_hint             # last stored child of a node (verified by key on use)
    cdef uint32_t _lru_head
    cdef uint32_t _lru_tail
    cdef uint32_t *_free_ids         # stack of free ids below _fresh (ids at or above
    cdef uint32_t _n_free            # _shrink_to excluded while the pool halves)
    cdef uint32_t _free_f            # while halving: [0, _free_f) of the stack is unfiltered
    cdef uint32_t _shrink_to         # 0, or the capacity the pool is halving to
    cdef uint32_t _shrink_at         # phase 2: ids below it are left to move; 3: hints
    cdef int _shrink_phase           # 0 none, 1 filtering free ids, 2 moving nodes down,
                                     # 3 clearing hints, 4 giving memory back
    cdef public int64_t _shrink_budget  # work units a step (tests set it small)

    cdef int64_t *_inst_blocks       # holdings per instance
    cdef int32_t *_seg_start         # match scratch, per instance

    cdef readonly int64_t n_nodes
    cdef readonly int64_t n_blocks
    cdef readonly int64_t n_orphan_stores
    cdef readonly double last_store_time
    cdef readonly int64_t _debug_rebuilds   # halvings of the node pool completed
    cdef readonly int64_t _debug_grows      # in-place growths of the node arrays
    cdef readonly int64_t _debug_checks

    cdef void _free_all(self) noexcept
    cdef void _unmap_nodes(self) noexcept
    cdef int _check_instance(self, int instance) except -1
    cdef int32_t *_check_out(self, object out) except NULL
    cdef Py_ssize_t _match(self, object block_hashes, object out) except -1
    cdef int _map_nodes(self, uint32_t node_cap) except -1
    cdef int _resize_nodes(self, uint64_t ncap) except -1
    cdef int _grow_nodes(self) except -1
    cdef uint32_t _find(self, uint64_t key) noexcept nogil
    cdef RadixTable *_table_reserve(self, uint64_t h) except NULL
    cdef void _table_delete(self, uint64_t key) noexcept nogil
    cdef uint32_t _find_or_alloc(self, uint64_t key) except? 0xFFFFFFFF
    cdef void _free_node(self, uint32_t node) noexcept nogil
    cdef void _lru_unlink(self, uint32_t node) noexcept nogil
    cdef void _lru_push_tail(self, uint32_t node) noexcept nogil
    cdef int64_t _drop_node_holdings(self, uint32_t node) noexcept nogil
    cdef int _maybe_shrink(self) except -1
    cdef void _shrink_cancel(self) noexcept nogil
    cdef int64_t _filter_free(self, int64_t budget) noexcept nogil
    cdef uint32_t _pop_free(self) noexcept nogil
    cdef void _move_node(self, uint32_t src, uint32_t dst) noexcept nogil
    cdef int _debug_check(self) except -1
    cdef Py_ssize_t _match_one_word(self, const uint64_t *hashes, Py_ssize_t n,
                                    int32_t *out) noexcept nogil
    cdef Py_ssize_t match_ptr(self, const uint64_t *hashes, Py_ssize_t n,
                              int32_t *out) noexcept nogil
