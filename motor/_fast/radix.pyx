# cython: language_level=3
"""Prefix index over chained block hashes, for many instances and storage tiers.

A block hash (``motor._fast.hashing``) already encodes its whole prefix, so the
index is a *flattened* radix tree: one node per distinct block hash, found in an
open-addressing hash table, holding a bitset of (instance, tier) holders. Parent
links and holder-less path nodes are not needed: :meth:`PrefixIndex.match` walks
the query's own hashes, and a node is freed as soon as its last holder goes.

Match semantics (exact): for instance ``i`` let ``R_i`` be the largest ``k`` such
that ``i`` holds each of the query's blocks ``0 .. k-1`` in at least one tier. Then
``out[i, t]`` is the number of those ``R_i`` leading blocks whose *fastest* tier
held by ``i`` is ``t`` (TIER_DEVICE < TIER_HOST < TIER_DISK), so
``out[i].sum() == R_i``. A block that ``i`` holds after a gap does not count.

Complexity: store / remove O(blocks) expected (a growth of the node pool is an mremap,
a growth of one of the 256 hash sub-tables moves its keys only); match O(R) where
R = max_i R_i (+ O(changes) when holders or tiers change along the prefix); clear
O(nodes); eviction O(evicted); a halving of the pool (below a quarter full) is spread
over calls, a bounded step each. Memory: see :attr:`PrefixIndex.memory_bytes` and docs/fast.md.
"""
from libc.stdint cimport uint32_t, uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset, memcpy
from cpython.buffer cimport PyBuffer_Release

cimport numpy as cnp
import numpy as np

from motor._fast._common cimport (mf_get_uint_buffer, MF_BUF_NOT_CONTIGUOUS, MOTOR_DEBUG,
                                  mf_prefetch, mf_popcount64, mf_ctz64, mf_likely,
                                  mf_unlikely)

cnp.import_array()

cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    #define RADIX_NO_NODE 0xFFFFFFFFu
    #define RADIX_HOME_MUL 0x9E3779B97F4A7C15ULL
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    #if defined(__linux__) && defined(MREMAP_MAYMOVE)
    #define RADIX_REMAP_IN_PLACE 1
    #else
    #define RADIX_REMAP_IN_PLACE 0
    #endif
    /* The node arrays are zeroed anonymous memory. On Linux they grow by mremap: the pages
       move with their page tables, nothing is copied and the new tail stays zero until it is
       first written, so a growth costs the same at 1 K and at 1 M nodes. No transparent-huge-
       page advice: where the kernel's THP defrag is "madvise" (Debian's default), a page
       fault in an advised range may compact memory first, synchronously, and a grown
       array's tail faults in while requests are routed. Elsewhere: calloc / realloc. */
    static inline void *radix_map(size_t n) {
    #if RADIX_REMAP_IN_PLACE
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    #else
        return calloc(1, n);
    #endif
    }
    /* p resized from old to n bytes, a new tail zeroed; NULL (p unchanged) on failure. */
    static inline void *radix_remap(void *p, size_t old, size_t n) {
    #if RADIX_REMAP_IN_PLACE
        void *q = mremap(p, old, n, MREMAP_MAYMOVE);
        return q == MAP_FAILED ? NULL : q;
    #else
        void *q = realloc(p, n);
        if (q != NULL && n > old) memset((char *)q + old, 0, n - old);
        return q;
    #endif
    }
    static inline void radix_unmap(void *p, size_t n) {
        if (p == NULL) return;
    #if RADIX_REMAP_IN_PLACE
        (void)munmap(p, n);
    #else
        (void)n;
        free(p);
    #endif
    }
    """
    const uint32_t RADIX_NO_NODE
    const uint64_t RADIX_HOME_MUL
    const int RADIX_REMAP_IN_PLACE
    void *radix_map(size_t n) nogil
    void *radix_remap(void *p, size_t old, size_t n) nogil
    void radix_unmap(void *p, size_t n) nogil

#: True when compiled with ``-DMOTOR_DEBUG=1``.
DEBUG = bool(MOTOR_DEBUG)
#: True where the node arrays grow in place (Linux ``mremap``); else a growth copies them.
REMAP_IN_PLACE = bool(RADIX_REMAP_IN_PLACE)
# Tier constants as plain Python ints (the C names are the cdef enum in radix.pxd).
globals().update({"TIER_DEVICE": <int>TIER_DEVICE, "TIER_HOST": <int>TIER_HOST,
                  "TIER_DISK": <int>TIER_DISK, "N_TIERS": <int>N_TIERS})

cdef object _np_zeros = np.zeros
cdef object _np_int32 = np.int32
cdef object _np_uint64 = np.uint64
cdef object _np_array = np.array
cdef object _np_ascontiguousarray = np.ascontiguousarray

cdef inline RadixTable *_table_of(RadixTable *tabs, uint64_t mixed) noexcept nogil:
    """The sub-table of a key whose mixed hash (``key * RADIX_HOME_MUL``) is ``mixed``."""
    return &tabs[mixed >> (64 - RADIX_TABLE_BITS)]


cdef inline uint64_t _home(const RadixTable *t, uint64_t mixed) noexcept nogil:
    """Home slot in ``t``: the mixed hash's bits under the sub-table's."""
    return (mixed << RADIX_TABLE_BITS) >> t.shift


cdef inline const RadixSlot *_home_slot(RadixTable *tabs, uint64_t key) noexcept nogil:
    cdef uint64_t h = key * RADIX_HOME_MUL
    cdef const RadixTable *t = _table_of(tabs, h)
    return &t.slots[_home(t, h)]


cdef inline uint32_t _find_in(RadixTable *tabs, uint64_t key) noexcept nogil:
    """:meth:`PrefixIndex._find` on the tables (inlined, no method call)."""
    cdef uint64_t h = key * RADIX_HOME_MUL
    cdef const RadixTable *t = _table_of(tabs, h)
    cdef const RadixSlot *slots = t.slots
    cdef uint64_t mask = t.mask
    cdef uint64_t i
    if mf_unlikely(key == 0):
        return RADIX_NO_NODE
    i = _home(t, h)
    while True:
        if slots[i].key == key:
            return slots[i].node
        if slots[i].key == 0:
            return RADIX_NO_NODE
        i = (i + 1) & mask


cdef inline int _table_shift(uint64_t cap) noexcept nogil:
    cdef int shift = 64
    while cap > 1:
        cap >>= 1
        shift -= 1
    return shift


cdef int _table_rehash(RadixTable *t, uint64_t cap) noexcept nogil:
    """Move ``t``'s keys to a new array of ``cap`` slots (a power of two); -1 (``t``
    unchanged) when out of memory."""
    cdef RadixSlot *ns = <RadixSlot *>calloc(cap, sizeof(RadixSlot))
    cdef RadixSlot *os = t.slots
    cdef uint64_t old = t.mask + 1 if os != NULL else 0
    cdef uint64_t i, j, mask = cap - 1
    cdef int shift = _table_shift(cap)
    if ns == NULL:
        return -1
    for i in range(old):
        if os[i].key != 0:
            j = ((os[i].key * RADIX_HOME_MUL) << RADIX_TABLE_BITS) >> shift
            while ns[j].key != 0:
                j = (j + 1) & mask
            ns[j] = os[i]
    free(os)
    t.slots = ns
    t.mask = mask
    t.shift = shift
    return 0


cdef inline uint64_t _step(uint64_t *active, uint64_t *p0, uint64_t *p1, uint64_t *p2,
                           const uint64_t *b, int base, Py_ssize_t j, int32_t *out,
                           int32_t *seg) noexcept nogil:
    """Block ``j`` of a match against one 64-instance word of a node's masks ``b`` (any,
    device, host, disk): the instances still in their leading run (``active``) that hold
    it, by fastest tier (``p0``..``p2``: the previous block's); an instance whose tier
    changed closes its segment in ``out`` (counts per tier) and opens one at ``j`` in
    ``seg``. Returns the word's new active mask. Inline, with scalars passed by address
    when there is one word: they stay in registers."""
    cdef uint64_t a = active[0] & b[0]
    cdef uint64_t n0 = a & b[1]
    cdef uint64_t n1 = a & b[2] & ~n0
    cdef uint64_t n2 = a & ~(n0 | n1)
    cdef uint64_t ch = (n0 ^ p0[0]) | (n1 ^ p1[0]) | (n2 ^ p2[0])
    cdef uint64_t m
    cdef int inst
    while ch:
        inst = mf_ctz64(ch)
        m = (<uint64_t>1) << inst
        ch &= ch - 1
        inst += base
        # close the segment in the previous best tier, open the new one
        if p0[0] & m:
            out[inst * 3 + 0] += <int32_t>(j - seg[inst])
        elif p1[0] & m:
            out[inst * 3 + 1] += <int32_t>(j - seg[inst])
        elif p2[0] & m:
            out[inst * 3 + 2] += <int32_t>(j - seg[inst])
        if a & m:
            seg[inst] = <int32_t>j
    p0[0] = n0
    p1[0] = n1
    p2[0] = n2
    active[0] = a
    return a


cdef int _get_hashes(object obj, Py_buffer *view, str name) except -1:
    """1-D contiguous uint64 view of ``obj`` (list/tuple converted, strided copied)."""
    if isinstance(obj, (list, tuple)):
        obj = _np_array(obj, dtype=_np_uint64)
    if mf_get_uint_buffer(obj, view, 8, name) == MF_BUF_NOT_CONTIGUOUS:
        obj = _np_ascontiguousarray(obj)
        mf_get_uint_buffer(obj, view, 8, name)
    return 0


cdef class PrefixIndex:
    """Which instances hold which leading blocks of a prompt, per storage tier.

    Parameters
    ----------
    max_instances : int, optional
        Number of instance slots, 1..256 (default 256). Instances are small ints
        ``0 .. max_instances-1`` (the caller maps endpoints / DP ranks to slots).
        Memory per node grows with ``ceil(max_instances / 64)``.

    Notes
    -----
    Not thread-safe; the GIL is held throughout every method. Timestamps passed
    to :meth:`store` are clamped to be non-decreasing (``max`` of all seen), so
    the eviction order (least recently stored first) and ``ts`` agree. Within one
    :meth:`store` call the deepest block counts as least recent, so eviction
    removes a prefix from its tail end first.
    """

    def __cinit__(self):
        self._tabs = NULL
        self._keys = NULL
        self._bits = NULL
        self._ts = NULL
        self._prev = NULL
        self._next = NULL
        self._hint = NULL
        self._inst_blocks = NULL
        self._seg_start = NULL
        self._free_ids = NULL
        self._node_cap = 0
        self._fresh = 0
        self._n_free = 0
        self._free_f = 0
        self._shrink_to = 0
        self._shrink_at = 0
        self._shrink_phase = 0
        self._shrink_budget = RADIX_SHRINK_BUDGET
        self._lru_head = RADIX_NO_NODE
        self._lru_tail = RADIX_NO_NODE

    def __init__(self, int max_instances=256):
        cdef int t
        if max_instances < 1 or max_instances > RADIX_MAX_INSTANCES:
            raise ValueError(f"max_instances is expected to be in 1..{RADIX_MAX_INSTANCES}, "
                             f"got {max_instances}")
        self._free_all()
        self.max_instances = max_instances
        self._nwords = (max_instances + 63) // 64
        self._stride = RADIX_MASKS_PER_WORD * self._nwords
        self._used_words = 0
        if max_instances % 64 == 0:
            self._last_word_mask = ~(<uint64_t>0)
        else:
            self._last_word_mask = ((<uint64_t>1) << (max_instances % 64)) - 1
        self._inst_blocks = <int64_t *>calloc(max_instances, sizeof(int64_t))
        self._seg_start = <int32_t *>calloc(max_instances, sizeof(int32_t))
        self._tabs = <RadixTable *>radix_map(RADIX_TABLES * sizeof(RadixTable))
        if self._inst_blocks == NULL or self._seg_start == NULL or self._tabs == NULL:
            self._free_all()
            raise MemoryError()
        for t in range(RADIX_TABLES):
            if _table_rehash(&self._tabs[t], RADIX_TABLE_MIN) < 0:
                self._free_all()
                raise MemoryError()
        self.n_nodes = 0
        self.n_blocks = 0
        self.n_orphan_stores = 0
        self.last_store_time = float("-inf")
        self._lru_head = RADIX_NO_NODE
        self._lru_tail = RADIX_NO_NODE
        self._map_nodes(RADIX_INITIAL_NODES)
        self._debug_rebuilds = 0

    def __dealloc__(self):
        self._free_all()

    cdef void _free_all(self) noexcept:
        cdef int t
        self._unmap_nodes()
        if self._tabs != NULL:
            for t in range(RADIX_TABLES):
                free(self._tabs[t].slots)
            radix_unmap(self._tabs, RADIX_TABLES * sizeof(RadixTable))
            self._tabs = NULL
        free(self._inst_blocks); self._inst_blocks = NULL
        free(self._seg_start); self._seg_start = NULL

    # ------------------------------------------------------------ storage

    cdef int _map_nodes(self, uint32_t node_cap) except -1:
        """Empty node arrays for ``node_cap`` nodes (the index holds none)."""
        cdef size_t stride = <size_t>self._stride
        self._unmap_nodes()
        self._node_cap = node_cap
        self._keys = <uint64_t *>radix_map(node_cap * sizeof(uint64_t))
        self._bits = <uint64_t *>radix_map(node_cap * stride * sizeof(uint64_t))
        self._ts = <double *>radix_map(node_cap * sizeof(double))
        self._prev = <uint32_t *>radix_map(node_cap * sizeof(uint32_t))
        self._next = <uint32_t *>radix_map(node_cap * sizeof(uint32_t))
        self._hint = <uint32_t *>radix_map(node_cap * sizeof(uint32_t))
        self._free_ids = <uint32_t *>radix_map(node_cap * sizeof(uint32_t))
        if (self._keys == NULL or self._bits == NULL or self._ts == NULL or self._prev == NULL
                or self._next == NULL or self._hint == NULL or self._free_ids == NULL):
            self._unmap_nodes()
            raise MemoryError()
        self._lru_head = RADIX_NO_NODE
        self._lru_tail = RADIX_NO_NODE
        return 0

    cdef int _resize_nodes(self, uint64_t ncap) except -1:
        """The node arrays resized in place to ``ncap`` nodes (:func:`radix_remap`; a shrink
        keeps ids below ``ncap`` only, the caller moved the others). Ids, links and hints
        stay. Old state is kept on MemoryError."""
        cdef uint64_t cap = self._node_cap
        cdef void **field[7]
        cdef size_t size[7]
        cdef void *q
        cdef int k, j
        if ncap >= RADIX_NO_NODE:
            raise MemoryError(f"PrefixIndex cannot hold {ncap} nodes")
        field[0] = <void **>&self._keys
        size[0] = sizeof(uint64_t)
        field[1] = <void **>&self._bits
        size[1] = <size_t>self._stride * sizeof(uint64_t)
        field[2] = <void **>&self._ts
        size[2] = sizeof(double)
        field[3] = <void **>&self._prev
        size[3] = sizeof(uint32_t)
        field[4] = <void **>&self._next
        size[4] = sizeof(uint32_t)
        field[5] = <void **>&self._hint
        size[5] = sizeof(uint32_t)
        field[6] = <void **>&self._free_ids
        size[6] = sizeof(uint32_t)
        for k in range(7):
            q = radix_remap(field[k][0], cap * size[k], ncap * size[k])
            if q == NULL:
                if ncap < cap:      # a mapping shrunk in place: kept whole (cannot happen)
                    continue
                for j in range(k):
                    q = radix_remap(field[j][0], ncap * size[j], cap * size[j])
                    if q != NULL:
                        field[j][0] = q
                raise MemoryError()
            field[k][0] = q
        self._node_cap = <uint32_t>ncap
        return 0

    cdef int _grow_nodes(self) except -1:
        """Double the node arrays in place: ids, links and hints stay, the new ids are
        fresh. Old state is kept on MemoryError."""
        self._resize_nodes(<uint64_t>self._node_cap * 2)
        self._debug_grows += 1
        return 0

    cdef void _unmap_nodes(self) noexcept:
        cdef size_t cap = self._node_cap
        radix_unmap(self._keys, cap * sizeof(uint64_t)); self._keys = NULL
        radix_unmap(self._bits, cap * <size_t>self._stride * sizeof(uint64_t)); self._bits = NULL
        radix_unmap(self._ts, cap * sizeof(double)); self._ts = NULL
        radix_unmap(self._prev, cap * sizeof(uint32_t)); self._prev = NULL
        radix_unmap(self._next, cap * sizeof(uint32_t)); self._next = NULL
        radix_unmap(self._hint, cap * sizeof(uint32_t)); self._hint = NULL
        radix_unmap(self._free_ids, cap * sizeof(uint32_t)); self._free_ids = NULL
        self._node_cap = 0
        self._fresh = 0
        self._n_free = 0
        self._free_f = 0
        self._shrink_to = 0
        self._shrink_phase = 0

    cdef uint32_t _find(self, uint64_t key) noexcept nogil:
        return _find_in(self._tabs, key)

    cdef RadixTable *_table_reserve(self, uint64_t h) except NULL:
        """The sub-table of mixed hash ``h``, with room for one more key: it doubles past
        half full."""
        cdef RadixTable *t = _table_of(self._tabs, h)
        if (<uint64_t>t.count + 1) * 2 > t.mask + 1:
            if _table_rehash(t, (t.mask + 1) * 2) < 0:
                raise MemoryError()
        return t

    cdef void _table_delete(self, uint64_t key) noexcept nogil:
        """Remove ``key`` (present) with backward-shift deletion: no tombstones. The
        sub-table halves below an eighth full (kept as it is when out of memory)."""
        cdef uint64_t h = key * RADIX_HOME_MUL
        cdef RadixTable *t = _table_of(self._tabs, h)
        cdef RadixSlot *slots = t.slots
        cdef uint64_t mask = t.mask
        cdef uint64_t i = _home(t, h)
        cdef uint64_t j, k
        while slots[i].key != key:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            if slots[j].key == 0:
                break
            k = _home(t, slots[j].key * RADIX_HOME_MUL)
            # Move slot j into the hole at i if i lies on j's probe path [k, j].
            if ((j - k) & mask) >= ((j - i) & mask):
                slots[i] = slots[j]
                i = j
        slots[i].key = 0
        slots[i].node = 0
        t.count -= 1
        if mask + 1 > RADIX_TABLE_MIN and <uint64_t>t.count * 8 < mask + 1:
            _table_rehash(t, (mask + 1) // 2)

    cdef void _lru_unlink(self, uint32_t node) noexcept nogil:
        cdef uint32_t p = self._prev[node], q = self._next[node]
        if p != RADIX_NO_NODE:
            self._next[p] = q
        else:
            self._lru_head = q
        if q != RADIX_NO_NODE:
            self._prev[q] = p
        else:
            self._lru_tail = p

    cdef void _lru_push_tail(self, uint32_t node) noexcept nogil:
        self._prev[node] = self._lru_tail
        self._next[node] = RADIX_NO_NODE
        if self._lru_tail != RADIX_NO_NODE:
            self._next[self._lru_tail] = node
        else:
            self._lru_head = node
        self._lru_tail = node

    cdef uint32_t _find_or_alloc(self, uint64_t key) except? 0xFFFFFFFF:
        """The node of ``key``; when absent, a new one at the LRU tail (one probe of the
        table either way). Node ids never change here: a full pool grows in place."""
        cdef uint32_t node
        cdef uint64_t h = key * RADIX_HOME_MUL
        cdef RadixTable *t = self._table_reserve(h)
        cdef uint64_t i = _home(t, h)
        while t.slots[i].key != 0:
            if t.slots[i].key == key:
                return t.slots[i].node
            i = (i + 1) & t.mask
        node = self._pop_free()
        if node == RADIX_NO_NODE and self._shrink_to and self._fresh >= self._shrink_to:
            self._shrink_cancel()       # no id left below the halving's capacity
            node = self._pop_free()
        if node == RADIX_NO_NODE:
            if self._fresh == self._node_cap:
                self._grow_nodes()
            node = self._fresh
            self._fresh += 1
        self._keys[node] = key
        self._hint[node] = RADIX_NO_NODE
        memset(self._bits + <size_t>node * self._stride, 0, self._stride * sizeof(uint64_t))
        self._lru_push_tail(node)
        t.slots[i].key = key
        t.slots[i].node = node
        t.count += 1
        self.n_nodes += 1
        return node

    cdef void _free_node(self, uint32_t node) noexcept nogil:
        """Forget ``node``; its id is free again, except at or above the capacity the pool
        is shrinking to (that id goes with the shrink)."""
        self._table_delete(self._keys[node])
        self._lru_unlink(node)
        self._keys[node] = 0
        self._prev[node] = RADIX_NO_NODE
        self._next[node] = RADIX_NO_NODE
        if self._shrink_to == 0 or node < self._shrink_to:
            self._free_ids[self._n_free] = node
            self._n_free += 1
        self.n_nodes -= 1

    cdef int64_t _drop_node_holdings(self, uint32_t node) noexcept nogil:
        """Clear every holder of ``node``; return the holdings removed."""
        cdef uint64_t *b = self._bits + <size_t>node * self._stride
        cdef uint64_t m
        cdef int w, t
        cdef int64_t removed = 0
        for w in range(self._nwords):
            for t in range(1, 4):
                m = b[4 * w + t]
                while m:
                    self._inst_blocks[w * 64 + mf_ctz64(m)] -= 1
                    removed += 1
                    m &= m - 1
                b[4 * w + t] = 0
            b[4 * w] = 0
        self.n_blocks -= removed
        return removed

    cdef int _maybe_shrink(self) except -1:
        """One bounded step (``_shrink_budget`` work units, RADIX_SHRINK_BUDGET unless a test
        sets it: about 0.1 ms) of halving the node pool, which starts when it is below a
        quarter full (floor RADIX_INITIAL_NODES). A halving to ``c``, phase by phase:

        1. the free-id stack is filtered from the top of its unfiltered part down: ids
           below ``c`` stay, the others are dropped (1 unit an id);
        2. the live nodes at or above ``c`` move to free ids below it, from the top down
           (RADIX_SHRINK_MOVE units a move, 1 an id looked at);
        3. the child hints that point at or above ``c`` are cleared (1 unit an id);
        4. the arrays shrink in place, RADIX_SHRINK_RELEASE units a node given back.

        Between steps the index works as always: new nodes take ids below ``c`` and a
        node freed at or above it is not reused. A small index halves within one step."""
        cdef int64_t budget = self._shrink_budget
        cdef uint32_t node, dst, target, end, i
        cdef uint64_t cap
        while budget > 0:
            if self._shrink_phase == 0:
                if not (self._node_cap > RADIX_INITIAL_NODES
                        and <uint64_t>self.n_nodes * 4 < self._node_cap):
                    return 0
                # the largest power of two below the capacity (its half, unless a halving
                # given up while giving memory back left it between two), floor 1024
                target = RADIX_INITIAL_NODES
                while <uint64_t>target * 2 < self._node_cap:
                    target *= 2
                self._shrink_to = target
                self._free_f = self._n_free        # the whole stack is unfiltered
                self._shrink_phase = 1
            target = self._shrink_to
            if self._shrink_phase == 1:
                budget -= self._filter_free(budget)
                if self._free_f > 0:
                    return 0
                self._shrink_at = self._fresh if self._fresh > target else target
                self._shrink_phase = 2
            if self._shrink_phase == 2:
                while self._shrink_at > target and budget > 0:
                    self._shrink_at -= 1
                    node = self._shrink_at
                    budget -= 1
                    if self._keys[node] != 0:
                        dst = self._pop_free()
                        if dst == RADIX_NO_NODE:    # the index filled again meanwhile
                            self._shrink_cancel()
                            return 0
                        self._move_node(node, dst)
                        budget -= RADIX_SHRINK_MOVE
                if self._shrink_at > target:
                    return 0
                if self._fresh > target:            # no live or free id is left above
                    self._fresh = target
                self._shrink_at = 0
                self._shrink_phase = 3
            if self._shrink_phase == 3:
                if budget <= 0:
                    return 0
                end = target
                if <int64_t>(end - self._shrink_at) > budget:
                    end = self._shrink_at + <uint32_t>budget
                for i in range(self._shrink_at, end):
                    if self._hint[i] != RADIX_NO_NODE and self._hint[i] >= target:
                        self._hint[i] = RADIX_NO_NODE
                budget -= end - self._shrink_at
                self._shrink_at = end
                if end < target:
                    return 0
                self._shrink_phase = 4
            if self._shrink_phase == 4:
                if budget <= 0:
                    return 0
                cap = self._node_cap - target
                if <int64_t>cap * RADIX_SHRINK_RELEASE > budget:
                    cap = <uint64_t>(budget // RADIX_SHRINK_RELEASE) + 1
                self._resize_nodes(self._node_cap - cap)
                budget -= <int64_t>cap * RADIX_SHRINK_RELEASE
                if self._node_cap > target:
                    return 0
                self._shrink_to = 0
                self._shrink_phase = 0
                self._debug_rebuilds += 1
        return 0

    cdef int64_t _filter_free(self, int64_t budget) noexcept nogil:
        """Filter up to ``budget`` ids of the free-id stack's unfiltered bottom part
        ``[0, _free_f)``, from its top down: an id below ``_shrink_to`` joins the filtered
        top part ``[_free_f, _n_free)``, another is dropped (the filtered top's last id takes
        its place). Returns the ids looked at."""
        cdef int64_t done = 0
        cdef uint32_t k
        while self._free_f > 0 and done < budget:
            done += 1
            k = self._free_f - 1
            if self._free_ids[k] >= self._shrink_to:
                self._n_free -= 1
                self._free_ids[k] = self._free_ids[self._n_free]
            self._free_f = k
        return done

    cdef uint32_t _pop_free(self) noexcept nogil:
        """A free id (while the pool halves: one below its new capacity, filtering up to
        RADIX_POP_FILTER more ids of the stack for it), or RADIX_NO_NODE."""
        if self._n_free == self._free_f and self._free_f > 0:
            self._filter_free(RADIX_POP_FILTER)
        if self._n_free == self._free_f:
            return RADIX_NO_NODE
        self._n_free -= 1
        return self._free_ids[self._n_free]

    cdef void _shrink_cancel(self) noexcept nogil:
        """Give a halving up (the index filled again): every free id below ``_fresh`` is
        free again, the dropped ones too. O(ids used), once."""
        cdef uint32_t i
        self._n_free = 0
        self._free_f = 0
        i = self._fresh
        while i > 0:
            i -= 1
            if self._keys[i] == 0:
                self._free_ids[self._n_free] = i
                self._n_free += 1
        self._shrink_to = 0
        self._shrink_phase = 0

    cdef void _move_node(self, uint32_t src, uint32_t dst) noexcept nogil:
        """Node ``src`` becomes node ``dst`` (free): its hash, masks, time, hint, LRU place
        and table slot. Hints elsewhere that point at ``src`` go stale (verified by key on
        use; phase 2 of a shrink clears them)."""
        cdef size_t stride = <size_t>self._stride
        cdef uint64_t key = self._keys[src]
        cdef uint64_t h = key * RADIX_HOME_MUL
        cdef RadixTable *t = _table_of(self._tabs, h)
        cdef uint64_t i = _home(t, h)
        cdef uint32_t p = self._prev[src], q = self._next[src]
        self._keys[dst] = key
        memcpy(self._bits + <size_t>dst * stride, self._bits + <size_t>src * stride,
               stride * sizeof(uint64_t))
        self._ts[dst] = self._ts[src]
        self._hint[dst] = self._hint[src]
        self._prev[dst] = p
        self._next[dst] = q
        if p != RADIX_NO_NODE:
            self._next[p] = dst
        else:
            self._lru_head = dst
        if q != RADIX_NO_NODE:
            self._prev[q] = dst
        else:
            self._lru_tail = dst
        while t.slots[i].key != key:
            i = (i + 1) & t.mask
        t.slots[i].node = dst
        self._keys[src] = 0
        self._hint[src] = RADIX_NO_NODE
        self._prev[src] = RADIX_NO_NODE
        self._next[src] = RADIX_NO_NODE

    cdef int _debug_check(self) except -1:
        self._debug_checks += 1
        if self.n_nodes < 0 or self.n_blocks < 0 or self.n_nodes > self._node_cap:
            raise AssertionError(f"PrefixIndex counters out of range: n_nodes={self.n_nodes} "
                                 f"n_blocks={self.n_blocks} node_cap={self._node_cap}")
        if (self.n_nodes == 0) != (self._lru_head == RADIX_NO_NODE):
            raise AssertionError("PrefixIndex LRU head disagrees with n_nodes")
        return 0

    # ------------------------------------------------------------ checks

    cdef int _check_instance(self, int instance) except -1:
        if instance < 0 or instance >= self.max_instances:
            raise ValueError(f"instance is expected to be in 0..{self.max_instances - 1}, "
                             f"got {instance}")
        return 0

    # ------------------------------------------------------------ API

    def store(self, int instance, int tier, uint64_t parent_hash, block_hashes,
              double now=0.0):
        """Record that ``instance`` holds ``block_hashes`` at ``tier``.

        Parameters
        ----------
        instance : int
            Instance slot, 0 .. max_instances-1.
        tier : int
            TIER_DEVICE (0), TIER_HOST (1) or TIER_DISK (2).
        parent_hash : int
            Hash of the block before ``block_hashes[0]``; 0 = root. Not needed for
            matching (hashes are chained); a non-zero parent that this instance
            does not hold counts in :attr:`n_orphan_stores` (hash-scheme mismatch
            or lost events show up there).
        block_hashes : 1-D buffer of uint64, length n (list of ints accepted)
            Block hashes, each chained to the previous one. 0 is not allowed.
        now : float, optional
            Store time in seconds (any monotonic clock), for :meth:`evict_older_than`
            and :meth:`evict_to_cap`. Clamped to be non-decreasing.

        Returns
        -------
        int
            Number of new (instance, tier, block) holdings (already-held ones are
            refreshed, not counted).

        Raises
        ------
        ValueError
            Bad instance or tier, or a block hash equal to 0 (nothing is stored).
        TypeError
            ``block_hashes`` is not a uint64 buffer.
        """
        cdef Py_buffer view
        cdef const uint64_t *h
        cdef Py_ssize_t n, k
        cdef uint32_t node, parent, child = RADIX_NO_NODE
        cdef RadixTable *tabs = self._tabs
        cdef uint32_t ahead[RADIX_STORE_AHEAD]
        cdef Py_ssize_t j, kk
        cdef int64_t before
        cdef bint relink
        cdef uint64_t bit
        cdef uint64_t *b
        cdef int w
        cdef int64_t added = 0
        cdef double ts
        self._check_instance(instance)
        if tier < 0 or tier >= N_TIERS:
            raise ValueError(f"tier is expected to be 0 (device), 1 (host) or 2 (disk), "
                             f"got {tier}")
        _get_hashes(block_hashes, &view, "block_hashes")
        try:
            h = <const uint64_t *>view.buf
            n = view.shape[0]
            for k in range(n):
                if h[k] == 0:
                    raise ValueError(f"block_hashes[{k}] is expected to be non-zero "
                                     f"(0 is the root sentinel), got 0")
            w = instance >> 6
            if w >= self._used_words:
                self._used_words = w + 1
            bit = (<uint64_t>1) << (instance & 63)
            parent = RADIX_NO_NODE
            if parent_hash != 0:
                parent = self._find(parent_hash)
                if (parent == RADIX_NO_NODE or
                        not (self._bits[<size_t>parent * self._stride + 4 * w] & bit)):
                    self.n_orphan_stores += 1
            if now > self.last_store_time:
                self.last_store_time = now
            ts = self.last_store_time
            # Deepest block first: after this loop the LRU order is leaf .. root,
            # so eviction trims prefixes from their tail end.
            # Node ids do not change in a store (the pool grows in place, nothing is freed),
            # so ``child``, ``parent`` and the nodes looked up ahead stay valid across
            # _find_or_alloc. The lookups of RADIX_STORE_AHEAD blocks are done first, their
            # home slots prefetched, apart from the LRU relinking that chains one block to the
            # next: their cache misses overlap.
            for k in range(n - 1, -1, -1):
                j = (n - 1 - k) % RADIX_STORE_AHEAD
                if j == 0:
                    for kk in range(min(RADIX_STORE_AHEAD, k + 1)):
                        mf_prefetch(_home_slot(tabs, h[k - kk]))
                    for kk in range(min(RADIX_STORE_AHEAD, k + 1)):
                        ahead[kk] = _find_in(tabs, h[k - kk])
                node = ahead[j]
                relink = True
                if node == RADIX_NO_NODE:
                    # not there when looked up: a new node (at the LRU tail), or, for a hash
                    # given twice in one call, the node its first made
                    before = self.n_nodes
                    node = self._find_or_alloc(h[k])
                    relink = before == self.n_nodes
                if relink and node != self._lru_tail:
                    self._lru_unlink(node)
                    self._lru_push_tail(node)
                self._ts[node] = ts
                if child != RADIX_NO_NODE:
                    self._hint[node] = child
                child = node
                b = self._bits + <size_t>node * self._stride + 4 * w
                if not (b[1 + tier] & bit):
                    b[1 + tier] |= bit
                    b[0] |= bit
                    added += 1
            if parent != RADIX_NO_NODE and child != RADIX_NO_NODE:
                self._hint[parent] = child
            self.n_blocks += added
            self._inst_blocks[instance] += added
        finally:
            PyBuffer_Release(&view)
        if self._shrink_phase:      # a halving of the pool goes on a step at each call
            self._maybe_shrink()
        if MOTOR_DEBUG:
            self._debug_check()
        return added

    def remove(self, int instance, int tier, block_hashes):
        """Forget that ``instance`` holds ``block_hashes`` at ``tier``.

        Blocks not held are skipped. A node left with no holder at any tier is
        freed at once (its hash-table slot, LRU entry and masks).

        Parameters
        ----------
        instance : int
            Instance slot, 0 .. max_instances-1.
        tier : int
            TIER_DEVICE, TIER_HOST or TIER_DISK.
        block_hashes : 1-D buffer of uint64 (list of ints accepted)

        Returns
        -------
        int
            Number of holdings removed.

        Raises
        ------
        ValueError
            Bad instance or tier.
        TypeError
            ``block_hashes`` is not a uint64 buffer.
        """
        cdef Py_buffer view
        cdef const uint64_t *h
        cdef Py_ssize_t n, k
        cdef uint32_t node
        cdef uint64_t bit, any_left
        cdef uint64_t *nb
        cdef uint64_t *b
        cdef int w, ww
        cdef int64_t removed = 0
        cdef uint32_t ahead[RADIX_STORE_AHEAD]
        cdef Py_ssize_t j, kk
        self._check_instance(instance)
        if tier < 0 or tier >= N_TIERS:
            raise ValueError(f"tier is expected to be 0 (device), 1 (host) or 2 (disk), "
                             f"got {tier}")
        _get_hashes(block_hashes, &view, "block_hashes")
        try:
            h = <const uint64_t *>view.buf
            n = view.shape[0]
            w = instance >> 6
            bit = (<uint64_t>1) << (instance & 63)
            for k in range(n):
                # Looked up RADIX_STORE_AHEAD blocks at a time (home slots prefetched first),
                # their masks prefetched: the misses overlap. Ids stay (a free moves no
                # other node); a node freed since its lookup (its hash given twice in this
                # call) no longer has its hash.
                j = k % RADIX_STORE_AHEAD
                if j == 0:
                    for kk in range(min(RADIX_STORE_AHEAD, n - k)):
                        mf_prefetch(_home_slot(self._tabs, h[k + kk]))
                    for kk in range(min(RADIX_STORE_AHEAD, n - k)):
                        node = _find_in(self._tabs, h[k + kk])
                        ahead[kk] = node
                        if node != RADIX_NO_NODE:
                            mf_prefetch(self._bits + <size_t>node * self._stride + 4 * w)
                node = ahead[j]
                if node == RADIX_NO_NODE or self._keys[node] != h[k]:
                    continue
                nb = self._bits + <size_t>node * self._stride
                b = nb + 4 * w
                if not (b[1 + tier] & bit):
                    continue
                b[1 + tier] &= ~bit
                removed += 1
                if not ((b[1] | b[2] | b[3]) & bit):
                    b[0] &= ~bit
                    any_left = 0
                    for ww in range(self._nwords):
                        any_left |= nb[4 * ww]
                    if any_left == 0:
                        self._free_node(node)
            self.n_blocks -= removed
            self._inst_blocks[instance] -= removed
        finally:
            PyBuffer_Release(&view)
        self._maybe_shrink()
        if MOTOR_DEBUG:
            self._debug_check()
        return removed

    def clear(self, int instance):
        """Forget every block of ``instance`` at every tier (the instance left).

        O(nodes): scans all nodes. Nodes left without holders are freed and the
        tables shrink when they fall below a quarter full.

        Returns
        -------
        int
            Number of holdings removed.

        Raises
        ------
        ValueError
            Bad instance.
        """
        cdef uint32_t node
        cdef uint64_t bit, any_left
        cdef uint64_t *nb
        cdef uint64_t *b
        cdef int w, ww, t
        cdef int64_t removed = 0
        self._check_instance(instance)
        w = instance >> 6
        bit = (<uint64_t>1) << (instance & 63)
        for node in range(self._fresh):
            if self._keys[node] == 0:
                continue
            nb = self._bits + <size_t>node * self._stride
            b = nb + 4 * w
            if not (b[0] & bit):
                continue
            for t in range(1, 4):
                if b[t] & bit:
                    removed += 1
                    b[t] &= ~bit
            b[0] &= ~bit
            any_left = 0
            for ww in range(self._nwords):
                any_left |= nb[4 * ww]
            if any_left == 0:
                self._free_node(node)
        self.n_blocks -= removed
        self._inst_blocks[instance] -= removed
        self._maybe_shrink()
        if MOTOR_DEBUG:
            self._debug_check()
        return removed

    def evict_older_than(self, double cutoff):
        """Drop every node last stored before ``cutoff`` (all its holders).

        Parameters
        ----------
        cutoff : float
            Same clock as ``store(..., now=)``; nodes with time < cutoff go.

        Returns
        -------
        int
            Number of nodes evicted.
        """
        cdef int64_t count = 0
        cdef uint32_t node
        while self._lru_head != RADIX_NO_NODE and self._ts[self._lru_head] < cutoff:
            node = self._lru_head
            self._drop_node_holdings(node)
            self._free_node(node)
            count += 1
        self._maybe_shrink()
        if MOTOR_DEBUG:
            self._debug_check()
        return count

    def evict_to_cap(self, int64_t max_nodes):
        """Drop least recently stored nodes until at most ``max_nodes`` remain.

        Parameters
        ----------
        max_nodes : int
            Cap on distinct block hashes (:attr:`n_nodes`), >= 0.

        Returns
        -------
        int
            Number of nodes evicted.

        Raises
        ------
        ValueError
            ``max_nodes < 0``.
        """
        cdef int64_t count = 0
        cdef uint32_t node
        if max_nodes < 0:
            raise ValueError(f"max_nodes is expected to be >= 0, got {max_nodes}")
        while self.n_nodes > max_nodes:
            node = self._lru_head
            self._drop_node_holdings(node)
            self._free_node(node)
            count += 1
        self._maybe_shrink()
        if MOTOR_DEBUG:
            self._debug_check()
        return count

    cdef Py_ssize_t _match_one_word(self, const uint64_t *q, Py_ssize_t n,
                                    int32_t *out) noexcept nogil:
        """:meth:`match_ptr` when only the first mask word is used (instances 0..63): the
        word's masks in registers; each block's node is the last stored child of the
        previous one when its key matches (one compare), else a table probe (inlined). A
        node whose tier masks are the previous node's changes nothing (the run's
        instances and their best tiers stay): its step is skipped."""
        cdef RadixTable *tabs = self._tabs
        cdef size_t stride = <size_t>self._stride
        cdef const uint64_t *bits = self._bits
        cdef const uint64_t *keys = self._keys
        cdef const uint32_t *hint = self._hint
        cdef int32_t *seg = self._seg_start
        cdef uint64_t a = self._last_word_mask if self._nwords == 1 else ~(<uint64_t>0)
        cdef uint64_t p0 = 0, p1 = 0, p2 = 0, ch, m, key, c1, c2, c3
        cdef const uint64_t *b
        cdef Py_ssize_t j, end = n
        cdef uint32_t node, nxt
        cdef int inst
        node = _find_in(tabs, q[0])
        if node == RADIX_NO_NODE:
            return 0
        b = bits + node * stride
        c1 = b[1]
        c2 = b[2]
        c3 = b[3]
        if _step(&a, &p0, &p1, &p2, b, 0, 0, out, seg) == 0:
            return 0
        for j in range(1, n):
            key = q[j]
            nxt = hint[node]
            if nxt == RADIX_NO_NODE or keys[nxt] != key or key == 0:
                nxt = _find_in(tabs, key)
                if nxt == RADIX_NO_NODE:
                    end = j
                    break
            node = nxt
            b = bits + node * stride
            # the any mask b[0] is the tiers' union: the three tier masks decide
            if b[1] != c1 or b[2] != c2 or b[3] != c3:
                c1 = b[1]
                c2 = b[2]
                c3 = b[3]
                if _step(&a, &p0, &p1, &p2, b, 0, j, out, seg) == 0:
                    end = j
                    break
        ch = p0 | p1 | p2
        while ch:
            inst = mf_ctz64(ch)
            m = (<uint64_t>1) << inst
            ch &= ch - 1
            if p0 & m:
                out[inst * 3 + 0] += <int32_t>(end - seg[inst])
            elif p1 & m:
                out[inst * 3 + 1] += <int32_t>(end - seg[inst])
            else:
                out[inst * 3 + 2] += <int32_t>(end - seg[inst])
        return end

    cdef Py_ssize_t match_ptr(self, const uint64_t *q, Py_ssize_t n,
                              int32_t *out) noexcept nogil:
        """Core of :meth:`match`: ``out`` (int32[max_instances * 3], zeroed) gets
        the per-tier counts; returns max_i R_i."""
        cdef uint64_t active[RADIX_MAX_WORDS]
        cdef uint64_t p0[RADIX_MAX_WORDS]
        cdef uint64_t p1[RADIX_MAX_WORDS]
        cdef uint64_t p2[RADIX_MAX_WORDS]
        cdef uint32_t ring[32]
        # Only the words up to the highest instance ever stored can hold a bit: 64 endpoints
        # read one word of each node's masks, not max_instances / 64.
        cdef int W = self._used_words, w, inst
        cdef int stride = self._stride
        cdef Py_ssize_t j, end = n, pre
        cdef uint32_t node
        cdef const uint64_t *b
        cdef uint64_t ch, m, anyact
        cdef uint64_t a1 = 0, q0 = 0, q1 = 0, q2 = 0     # the masks of word 0 when W == 1
        cdef int32_t *seg = self._seg_start
        cdef RadixTable *tabs = self._tabs
        cdef const uint64_t *bits = self._bits
        cdef const uint64_t *keys = self._keys
        cdef const uint32_t *hint = self._hint
        cdef int misses = RADIX_PREFETCH_SLOTS
        for w in range(W):
            active[w] = ~(<uint64_t>0)
            p0[w] = 0
            p1[w] = 0
            p2[w] = 0
        if n <= 0 or W == 0:
            return 0
        if W == 1:
            return self._match_one_word(q, n, out)
        if W == self._nwords:
            active[W - 1] = self._last_word_mask
        a1 = active[0]
        pre = n if n < RADIX_PREFETCH_SLOTS else RADIX_PREFETCH_SLOTS
        for j in range(pre):
            mf_prefetch(_home_slot(tabs, q[j]))
        pre = n if n < RADIX_PREFETCH_NODES else RADIX_PREFETCH_NODES
        for j in range(pre):
            node = self._find(q[j])
            ring[j & 31] = node
            if node != RADIX_NO_NODE:
                mf_prefetch(bits + <size_t>node * stride)
        for j in range(n):
            # Table slots are prefetched only while child hints miss.
            if misses and j + RADIX_PREFETCH_SLOTS < n:
                mf_prefetch(_home_slot(tabs, q[j + RADIX_PREFETCH_SLOTS]))
            if j + RADIX_PREFETCH_NODES < n:
                # The previous block's last stored child is usually this block:
                # checking it (one key compare) skips the random table probe.
                node = ring[(j + RADIX_PREFETCH_NODES - 1) & 31]
                if node != RADIX_NO_NODE:
                    node = hint[node]
                    if node != RADIX_NO_NODE and (keys[node] != q[j + RADIX_PREFETCH_NODES]
                                                  or keys[node] == 0):
                        node = RADIX_NO_NODE
                if node == RADIX_NO_NODE:
                    node = self._find(q[j + RADIX_PREFETCH_NODES])
                    misses = RADIX_PREFETCH_SLOTS
                elif misses:
                    misses -= 1
                ring[(j + RADIX_PREFETCH_NODES) & 31] = node
                if node != RADIX_NO_NODE:
                    mf_prefetch(bits + <size_t>node * stride)
            node = ring[j & 31]
            if node == RADIX_NO_NODE:
                end = j
                break
            b = bits + <size_t>node * stride
            if W == 1:          # up to 64 instances: the masks in registers
                anyact = _step(&a1, &q0, &q1, &q2, b, 0, j, out, seg)
            else:
                anyact = 0
                for w in range(W):
                    anyact |= _step(&active[w], &p0[w], &p1[w], &p2[w], b + 4 * w, w * 64, j,
                                    out, seg)
            if anyact == 0:
                end = j
                break
        if W == 1:
            p0[0] = q0
            p1[0] = q1
            p2[0] = q2
        for w in range(W):
            ch = p0[w] | p1[w] | p2[w]
            while ch:
                inst = mf_ctz64(ch)
                m = (<uint64_t>1) << inst
                ch &= ch - 1
                inst += w * 64
                if p0[w] & m:
                    out[inst * 3 + 0] += <int32_t>(end - seg[inst])
                elif p1[w] & m:
                    out[inst * 3 + 1] += <int32_t>(end - seg[inst])
                else:
                    out[inst * 3 + 2] += <int32_t>(end - seg[inst])
        return end

    cdef int32_t *_check_out(self, object out) except NULL:
        cdef cnp.ndarray arr
        if not isinstance(out, cnp.ndarray):
            raise TypeError(f"out is expected to be a numpy int32 array of shape "
                            f"({self.max_instances}, 3), got {type(out).__name__}")
        arr = <cnp.ndarray>out
        if cnp.PyArray_TYPE(arr) != cnp.NPY_INT32:
            raise TypeError(f"out is expected to have dtype int32, got {out.dtype}")
        if (cnp.PyArray_NDIM(arr) != 2 or cnp.PyArray_DIM(arr, 0) != self.max_instances
                or cnp.PyArray_DIM(arr, 1) != N_TIERS):
            raise ValueError(f"out is expected to have shape ({self.max_instances}, 3), "
                             f"got {out.shape}")
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISWRITEABLE(arr):
            raise ValueError("out is expected to be C-contiguous and writeable")
        return <int32_t *>cnp.PyArray_DATA(arr)

    cdef Py_ssize_t _match(self, object block_hashes, object out) except -1:
        cdef Py_buffer view
        cdef int32_t *dst = self._check_out(out)
        cdef Py_ssize_t end
        _get_hashes(block_hashes, &view, "block_hashes")
        try:
            memset(dst, 0, self.max_instances * N_TIERS * sizeof(int32_t))
            end = self.match_ptr(<const uint64_t *>view.buf, view.shape[0], dst)
        finally:
            PyBuffer_Release(&view)
        return end

    def match(self, block_hashes, out=None):
        """Per instance and tier, how many leading query blocks are cached.

        Parameters
        ----------
        block_hashes : 1-D buffer of uint64, length n (list of ints accepted)
            The prompt's chained block hashes, from the root.
        out : numpy.ndarray of int32, shape (max_instances, 3), optional
            Reused output (overwritten); allocated when None.

        Returns
        -------
        numpy.ndarray of int32, shape (max_instances, 3)
            ``out[i, t]``: number of blocks in instance ``i``'s leading run (blocks
            0..R_i-1 all held by ``i`` at some tier) whose fastest tier is ``t``.
            ``out[i].sum()`` is R_i (the cached prefix in blocks).

        Raises
        ------
        TypeError
            Wrong dtype of ``block_hashes`` or ``out``.
        ValueError
            Wrong shape / layout of ``out``.
        """
        if out is None:
            out = _np_zeros((self.max_instances, N_TIERS), _np_int32)
        self._match(block_hashes, out)
        return out

    def match_into(self, block_hashes, out):
        """Like :meth:`match` into a required ``out``; returns ``max_i R_i``.

        Parameters
        ----------
        block_hashes : 1-D buffer of uint64
        out : numpy.ndarray of int32, shape (max_instances, 3), C-contiguous, writeable

        Returns
        -------
        int
            Longest cached prefix over all instances, in blocks (0 = no hit).
        """
        return self._match(block_hashes, out)

    # ------------------------------------------------------------ introspection

    @property
    def memory_bytes(self):
        """Bytes of C memory reserved: table slots + node arrays + per-instance arrays.

        Per node of capacity: 8 (hash) + 32 * ceil(max_instances/64) (masks) + 8 (time)
        + 8 (LRU links) + 4 (child hint) + 4 (free id); the node capacity doubles in place
        when full and halves below a quarter full (a bounded step at each call, see
        ``_maybe_shrink``), floor 1024 nodes. Table: 16
        bytes a slot, 2 to 8 slots a key (each of the 256 sub-tables doubles past half full
        and halves below an eighth, floor 16 slots). On Linux a grown array's pages are
        counted here before they are first written (and so resident).
        """
        cdef size_t per_node = (sizeof(uint64_t) + self._stride * sizeof(uint64_t)
                                + sizeof(double) + 4 * sizeof(uint32_t))
        cdef size_t slots = 0
        cdef int t
        for t in range(RADIX_TABLES):
            slots += self._tabs[t].mask + 1
        return (<size_t>self._node_cap * per_node + slots * sizeof(RadixSlot)
                + RADIX_TABLES * sizeof(RadixTable)
                + self.max_instances * (sizeof(int64_t) + sizeof(int32_t)))

    @property
    def _shrinking(self):
        """True while a halving of the node pool is under way (for tests)."""
        return self._shrink_phase != 0

    @property
    def node_capacity(self):
        """Nodes the arrays can hold before they next grow."""
        return self._node_cap

    def instance_blocks(self, int instance):
        """Number of (tier, block) holdings of ``instance``."""
        self._check_instance(instance)
        return self._inst_blocks[instance]

    def holders(self, uint64_t block_hash):
        """Sorted list of ``(instance, tier)`` holding ``block_hash`` (for tests / debug)."""
        cdef uint32_t node = self._find(block_hash)
        cdef uint64_t *nb
        cdef int w, t
        cdef uint64_t m
        result = []
        if node == RADIX_NO_NODE:
            return result
        nb = self._bits + <size_t>node * self._stride
        for w in range(self._nwords):
            for t in range(1, 4):
                m = nb[4 * w + t]
                while m:
                    result.append((w * 64 + mf_ctz64(m), t - 1))
                    m &= m - 1
        result.sort()
        return result

    def lru_hashes(self):
        """Block hashes from least to most recently stored (eviction order), uint64[n_nodes]."""
        out = np.empty(self.n_nodes, dtype=_np_uint64)
        cdef uint64_t[::1] o = out
        cdef uint32_t node = self._lru_head
        cdef Py_ssize_t i = 0
        while node != RADIX_NO_NODE:
            o[i] = self._keys[node]
            i += 1
            node = self._next[node]
        return out

    def _check_invariants(self):
        """Recompute every derived quantity from scratch; raise AssertionError on a
        mismatch. O(nodes); for tests."""
        cdef uint32_t node, prev = RADIX_NO_NODE, cnt = 0
        cdef uint64_t *nb
        cdef uint64_t any_w, anyall, s
        cdef int w, t
        cdef int64_t blocks = 0, occupied = 0
        cdef double last_ts = float("-inf")
        cdef uint64_t si, held
        cdef int i, ti
        cdef int64_t free_nodes
        cdef uint32_t k
        cdef RadixTable *tab
        per_inst = [0] * self.max_instances
        node = self._lru_head
        while node != RADIX_NO_NODE:
            if self._prev[node] != prev:
                raise AssertionError(f"LRU prev link broken at node {node}")
            if self._keys[node] == 0:
                raise AssertionError(f"free node {node} on the LRU list")
            if self._find(self._keys[node]) != node:
                raise AssertionError(f"node {node} not found by its hash")
            if self._ts[node] < last_ts:
                raise AssertionError("LRU order disagrees with timestamps")
            last_ts = self._ts[node]
            nb = self._bits + <size_t>node * self._stride
            anyall = 0
            for w in range(self._nwords):
                any_w = nb[4 * w + 1] | nb[4 * w + 2] | nb[4 * w + 3]
                if any_w != nb[4 * w]:
                    raise AssertionError(f"any-mask of node {node} word {w} is stale")
                if w == self._nwords - 1 and (any_w & ~self._last_word_mask):
                    raise AssertionError(f"node {node} has holders beyond max_instances")
                anyall |= any_w
                for t in range(1, 4):
                    s = nb[4 * w + t]
                    blocks += mf_popcount64(s)
                    while s:
                        per_inst[w * 64 + mf_ctz64(s)] += 1
                        s &= s - 1
            if anyall == 0:
                raise AssertionError(f"node {node} has no holder but was not freed")
            cnt += 1
            prev = node
            node = self._next[node]
        if prev != self._lru_tail:
            raise AssertionError("LRU tail is wrong")
        if cnt != self.n_nodes:
            raise AssertionError(f"n_nodes {self.n_nodes} != {cnt} nodes on the LRU list")
        for ti in range(RADIX_TABLES):
            tab = &self._tabs[ti]
            held = 0
            for si in range(tab.mask + 1):
                if tab.slots[si].key != 0:
                    held += 1
                    if _table_of(self._tabs, tab.slots[si].key * RADIX_HOME_MUL) != tab:
                        raise AssertionError(f"hash {tab.slots[si].key} in sub-table {ti}")
            if held != tab.count:
                raise AssertionError(f"sub-table {ti} holds {held} keys, counts {tab.count}")
            if held * 2 > tab.mask + 1 or tab.mask + 1 < RADIX_TABLE_MIN:
                raise AssertionError(f"sub-table {ti}: {held} keys in {tab.mask + 1} slots")
            occupied += held
        seen = set()
        for k in range(self._n_free):
            node = self._free_ids[k]
            if node >= self._fresh or self._keys[node] != 0 or node in seen:
                raise AssertionError(f"free id {node} is fresh, has a hash or is listed twice")
            if self._shrink_to and node >= self._shrink_to and k >= self._free_f:
                raise AssertionError(f"free id {node} at or above the halving's capacity in "
                                     f"the filtered part of the stack")
            seen.add(node)
        for k in range(min(self._fresh, self._node_cap)):
            if self._hint[k] != RADIX_NO_NODE and self._hint[k] >= self._node_cap:
                raise AssertionError(f"node {k}'s hint {self._hint[k]} is past the capacity")
        free_nodes = 0
        for k in range(self._fresh):
            if self._keys[k] == 0 and k not in seen:
                if not (self._shrink_to and k >= self._shrink_to):
                    raise AssertionError(f"id {k} is neither live nor free")
                free_nodes += 1     # dropped by the shrink
        if (self._n_free + free_nodes + self.n_nodes != self._fresh
                or self._fresh > self._node_cap):
            raise AssertionError(f"{self._n_free} free + {free_nodes} dropped + {self.n_nodes} "
                                 f"live ids, {self._fresh} used of {self._node_cap}")
        if occupied != self.n_nodes:
            raise AssertionError(f"table holds {occupied} keys, n_nodes is {self.n_nodes}")
        if blocks != self.n_blocks:
            raise AssertionError(f"n_blocks {self.n_blocks} != {blocks} counted")
        for i in range(self.max_instances):
            if per_inst[i] != self._inst_blocks[i]:
                raise AssertionError(f"instance {i}: {self._inst_blocks[i]} blocks recorded, "
                                     f"{per_inst[i]} counted")
        return True
