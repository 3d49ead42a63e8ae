# cython: language_level=3
"""``kv_affinity``'s decision under the token cost in one compiled call: match, gather, score.

The decision reads, per request: the leading cached blocks of the request's key in the
exact index and in the group's approximate index (:class:`motor._fast.radix.PrefixIndex`,
their tier-wise larger value), each candidate's slot, its row of those counts and its load
in flight (:func:`motor._fast.columns.gather_ptr`), and picks the cheapest
(:func:`motor._fast.scoring.score_ptr`, ``coordinator.kv.cost: tokens``). Done step by step
from Python, each step makes its numpy arrays and views (a 256 x 3 match buffer, the
candidates' rows, three load columns, the chosen row) and the objects cost more than the
work: about 37,000 counted instructions per decision for 2 candidates. :meth:`TokenPick.pick`
does the same steps on buffers it owns, with the same results (the numpy path stays, for
``cost: time`` and for debug logging, and the tests compare the two).

Only the rows a match can write are cleared: an index writes rows below 64 x the mask words
it has used (:attr:`PrefixIndex._used_words`); a candidate whose slot lies above them has no
blocks there.
"""
from cpython.list cimport PyList_GET_SIZE
from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memset
from libc.math cimport INFINITY

cimport numpy as cnp

from motor._fast.columns cimport gather_ptr
from motor._fast.radix cimport PrefixIndex, RADIX_MAX_INSTANCES
from motor._fast.scoring cimport (SCORING_N_TIERS, ScoreInputs, ScoreParams, f64_column,
                                   score_ptr)

cnp.import_array()


cdef Py_ssize_t _match(PrefixIndex index, const uint64_t *h, Py_ssize_t n,
                       int32_t *out) noexcept:
    """Leading cached blocks of ``h[:n]`` per instance and tier into ``out`` (its first
    rows, those the index can write); returns how many rows are valid (0: none)."""
    cdef Py_ssize_t rows
    if index is None or not index.n_nodes or n == 0:
        return 0
    rows = <Py_ssize_t>index._used_words * 64
    if rows > RADIX_MAX_INSTANCES:
        rows = RADIX_MAX_INSTANCES
    if rows == 0:
        return 0
    memset(out, 0, rows * SCORING_N_TIERS * sizeof(int32_t))
    index.match_ptr(h, n, out)
    return rows


cdef class TokenPick:
    """The cheapest candidate for a request, in prompt-token equivalents
    (:func:`motor._fast.scoring.pick`'s cost), from the KV indexes and the candidates.

    Parameters
    ----------
    block_size : int
        Tokens per block, > 0.
    tier_credit : sequence of 3 floats
        Share of a cached block's prefill saved, per tier (device, host, disk).
    w_prefill, w_decode, w_queue, guard_factor, guard_min_load : float
        As :func:`motor._fast.scoring.pick` (``coordinator.kv``'s ``prefill_weight``,
        ``decode_weight``, ``queue_penalty_tokens``, ``load_guard``,
        ``load_guard_min_tokens``).

    Raises
    ------
    ValueError
        ``block_size <= 0`` or ``tier_credit`` not of length 3.
    """
    cdef ScoreParams _p
    cdef Py_ssize_t _cap
    cdef cnp.intp_t *_sl
    cdef int32_t *_ov
    cdef double *_ld
    cdef int32_t _mx[RADIX_MAX_INSTANCES * SCORING_N_TIERS]
    cdef int32_t _ma[RADIX_MAX_INSTANCES * SCORING_N_TIERS]

    def __cinit__(self):
        self._cap = 0
        self._sl = NULL
        self._ov = NULL
        self._ld = NULL

    def __init__(self, Py_ssize_t block_size, tier_credit, double w_prefill=1.0,
                 double w_decode=0.0, double w_queue=0.0, double guard_factor=0.0,
                 double guard_min_load=0.0):
        cdef int t
        if block_size <= 0:
            raise ValueError(f"block_size is expected to be > 0, got {block_size}")
        credit = [float(c) for c in tier_credit]
        if len(credit) != SCORING_N_TIERS:
            raise ValueError(f"tier_credit is expected to hold 3 numbers, got {len(credit)}")
        self._p.block_size = <double>block_size
        for t in range(SCORING_N_TIERS):
            self._p.credit[t] = credit[t]
        self._p.w_prefill = w_prefill
        self._p.w_decode = w_decode
        self._p.w_queue = w_queue
        self._p.guard_factor = guard_factor
        self._p.guard_min_load = guard_min_load
        self._p.prompt_tokens = 0.0
        self._p.favored = -1
        self._p.favored_credit = 0.0

    def __dealloc__(self):
        free(self._sl)
        free(self._ov)
        free(self._ld)

    cdef int _grow(self, Py_ssize_t k) except -1:
        cdef void *p
        if k <= self._cap:
            return 0
        k = k if k > 2 * self._cap else 2 * self._cap
        p = realloc(self._sl, k * sizeof(cnp.intp_t))
        if p == NULL:
            raise MemoryError()
        self._sl = <cnp.intp_t *>p
        p = realloc(self._ov, k * SCORING_N_TIERS * sizeof(int32_t))
        if p == NULL:
            raise MemoryError()
        self._ov = <int32_t *>p
        p = realloc(self._ld, k * 3 * sizeof(double))
        if p == NULL:
            raise MemoryError()
        self._ld = <double *>p
        self._cap = k
        return 0

    def pick(self, list cands, dict slot_of, object hashes, PrefixIndex exact,
             PrefixIndex approx, Py_ssize_t prompt_tokens, Py_ssize_t start,
             Py_ssize_t alt_start=-1, object favored_key=None, double favored_credit=0.0,
             object loads=None):
        """The cheapest of ``cands``.

        Parameters
        ----------
        cands : list, length k
            Candidate endpoints (``key``; with ``loads`` None also the counters
            ``inflight_prefill_tokens``, ``inflight_decode_tokens``, ``inflight``:
            :func:`motor._fast.columns.gather`'s).
        slot_of : dict[str, int]
            Endpoint key -> KV index slot (0 .. 255).
        hashes : numpy.ndarray of uint64, shape (n,), or None
            The request's block hashes (None or empty: nothing is cached anywhere; a
            strided array is copied).
        exact, approx : PrefixIndex or None
            The indexes to match (a candidate's blocks are the tier-wise larger count).
        prompt_tokens : int
            Prompt length, tokens, >= 0.
        start : int
            Rotation offset of the last tie-break.
        alt_start : int
            The offset used instead when no candidate's key is ``favored_key`` (a
            session's stable start; -1: none).
        favored_key : str, optional
            The session's last endpoint: its cost is lowered by ``favored_credit``
            prompt-token equivalents for the comparison only.
        loads : tuple of 3 numpy float64 arrays of shape (k,), optional
            (prefill tokens, decode tokens, requests) in flight per candidate (the shared
            table's, with several workers); None: read from the candidates.

        Returns
        -------
        tuple or None
            ``(position, cost, device, host, disk, favored)``: the chosen candidate's
            position, its cost (prompt-token equivalents, without the credit), its leading
            cached blocks per tier, and the position of ``favored_key`` (-1: none);
            ``(-1, inf, 0, 0, 0, -1)`` without candidates. ``None`` when a candidate has no
            slot (the caller gives it one and asks again).

        Raises
        ------
        TypeError
            ``hashes`` not a numpy uint64 array, a load column not float64, an endpoint's
            counter not a number.
        ValueError
            Wrong shapes, ``prompt_tokens < 0``, a slot outside 0 .. 255.
        """
        cdef Py_ssize_t k = PyList_GET_SIZE(cands), j, s, t, pos, missing
        cdef Py_ssize_t favored = -1, rows_x, rows_a, n = 0
        cdef const uint64_t *h = NULL
        cdef cnp.ndarray ha
        cdef ScoreParams p
        cdef ScoreInputs x
        cdef double cost
        cdef int32_t a, b
        cdef int32_t *ov
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
        if hashes is not None:
            if not isinstance(hashes, cnp.ndarray):
                raise TypeError(f"hashes is expected to be a numpy uint64 array, "
                                f"got {type(hashes).__name__}")
            ha = <cnp.ndarray>hashes
            if cnp.PyArray_TYPE(ha) != cnp.NPY_UINT64:
                raise TypeError(f"hashes is expected to have dtype uint64, got {hashes.dtype}")
            if cnp.PyArray_NDIM(ha) != 1:
                raise ValueError(f"hashes is expected to be 1-D, got shape {hashes.shape}")
            if not cnp.PyArray_IS_C_CONTIGUOUS(ha):
                ha = cnp.PyArray_GETCONTIGUOUS(ha)      # a strided view: copied
            n = cnp.PyArray_DIM(ha, 0)
            h = <const uint64_t *>cnp.PyArray_DATA(ha)
        if k == 0:
            return -1, INFINITY, 0, 0, 0, -1
        self._grow(k)
        ov = self._ov
        memset(ov, 0, k * SCORING_N_TIERS * sizeof(int32_t))
        missing = gather_ptr(cands, slot_of, NULL, 0, favored_key, self._sl, ov,
                             self._ld if loads is None else NULL, &favored)
        if missing:
            return None
        rows_x = _match(exact, h, n, self._mx)
        rows_a = _match(approx, h, n, self._ma)
        for j in range(k):
            s = self._sl[j]
            if s < 0 or s >= RADIX_MAX_INSTANCES:
                raise ValueError(f"slot of candidate {j} is expected to be in "
                                 f"0..{RADIX_MAX_INSTANCES - 1}, got {s}")
            if s >= rows_x and s >= rows_a:
                continue
            for t in range(SCORING_N_TIERS):
                a = self._mx[SCORING_N_TIERS * s + t] if s < rows_x else 0
                b = self._ma[SCORING_N_TIERS * s + t] if s < rows_a else 0
                ov[SCORING_N_TIERS * j + t] = a if a > b else b
        if loads is None:
            x.prefill_tokens = self._ld
            x.decode_tokens = self._ld + k
            x.queue = self._ld + 2 * k
        else:
            if not isinstance(loads, tuple) or len(<tuple>loads) != 3:
                raise TypeError("loads is expected to be a tuple of 3 float64 arrays")
            x.prefill_tokens = f64_column((<tuple>loads)[0], "loads[0]", k)
            x.decode_tokens = f64_column((<tuple>loads)[1], "loads[1]", k)
            x.queue = f64_column((<tuple>loads)[2], "loads[2]", k)
        x.overlap = ov
        x.n = k
        x.cand32 = NULL
        x.cand64 = NULL
        x.k = k
        p = self._p
        p.prompt_tokens = <double>prompt_tokens
        p.favored = favored
        p.favored_credit = favored_credit if favored >= 0 else 0.0
        if favored < 0 and alt_start >= 0:
            start = alt_start
        pos = score_ptr(&p, &x, start, NULL, &cost)
        return (pos, cost, ov[SCORING_N_TIERS * pos], ov[SCORING_N_TIERS * pos + 1],
                ov[SCORING_N_TIERS * pos + 2], favored)
