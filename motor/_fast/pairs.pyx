# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Joint (prefill, decode) choice of the PD modes: one cost in seconds over every pair,
and the decode instances alone (conditional disaggregation).

Per prefill instance ``p`` and decode instance ``d`` (rates per instance, columns
``(step_s, prefill_s_per_token, decode_s_per_seq)`` as :mod:`motor._fast.scoring`)::

    ttft(work, running, r) = steps * (r.step_s + r.decode_s_per_seq * running)
                             + r.prefill_s_per_token * work,
                             steps = max(1, ceil(work / chunk_tokens))            s
    decode(d)  = decode_tokens * (step_s_d + decode_s_per_seq_d * (running_d + 1))
                                                  this request's decode on d      s
                 + stall_weight * running_d * decode_s_per_seq_d * decode_tokens
                      the delay its decode steps impose on d's running sequences
    pair(p, d) = ttft(p_work_p, p_running_p, r_p)          prefill on p, its cache
                 + stall_weight * p_running_p * prefill_s_per_token_p * p_uncached_p
                                   the stall its prefill imposes on p's running prefills
                 + transfer_s_per_token[p, d] * d_uncached_d   KV not cached on d
                 + step_s_d + decode_s_per_seq_d * running_d   d's first step
                 + prefill_s_per_token_d * d_queued_d          d's queued local prefills
                 + decode(d)
                 + handoff_s    what a pair's hand-off costs beyond these (learned)  s
    local(d)   = ttft(d_queued_d + d_uncached_d, running_d, r_d)   prefill on d itself
                 + stall_weight * running_d * prefill_s_per_token_d * d_uncached_d
                                   the stall its prefill imposes on d's running batch
                 + decode(d)                                                       s

The argmin over the pairs wins, ties to the first pair in the order ``p * D + d`` rotated
by ``start``; a decode instance alone (``local``) wins only when its cost is strictly
lower than the best pair's (ties rotated by ``start`` among the decode instances).
"""
from libc.math cimport ceil, INFINITY
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp

cnp.import_array()


cdef inline double _ttft(double work, double running, const double *r,
                         double chunk) noexcept nogil:
    cdef double steps = ceil(work / chunk)
    if steps < 1.0:
        steps = 1.0
    return steps * (r[0] + r[2] * running) + r[1] * work


cdef struct _Best:
    Py_ssize_t p, d
    double cost, best, lbest


cdef void _pick(Py_ssize_t P, Py_ssize_t D, const double *p_work, const double *p_running,
                const double *p_rates, const double *d_queued, const double *d_uncached,
                const double *d_running, const double *d_rates, const double *xfer,
                double decode_tokens, double chunk_tokens, bint local, double stall_weight,
                Py_ssize_t start, const double *p_unc, double handoff_s,
                _Best *out) noexcept nogil:
    """The module docstring's argmin over C-contiguous columns (rates rows of 3, ``xfer``
    P x D row-major); ``p_unc`` NULL = no stall term on P. Fills ``out``."""
    cdef Py_ssize_t n, i, p, d, bp = -1, bd = -1, ld = -1, start_n, start_d
    cdef double c, best = INFINITY, lbest = INFINITY, dec
    cdef double pbuf[64]
    cdef double dbuf[64]
    cdef double *buf_p = pbuf
    cdef double *buf_d = dbuf
    if P > 64 or D > 64:
        buf_p = <double *> malloc((P + D + 1) * sizeof(double))
        if buf_p == NULL:
            out.p = -2
            return
        buf_d = buf_p + P
    # per prefill instance its prefill, per decode instance its first step + decode
    for p in range(P):
        buf_p[p] = _ttft(p_work[p], p_running[p], &p_rates[3 * p], chunk_tokens)
        if p_unc != NULL:
            buf_p[p] = buf_p[p] + stall_weight * p_running[p] * p_rates[3 * p + 1] * p_unc[p]
    for d in range(D):
        buf_d[d] = ((d_rates[3 * d] + d_rates[3 * d + 2] * d_running[d]
                     + d_rates[3 * d + 1] * d_queued[d])
                    + decode_tokens * (d_rates[3 * d] + d_rates[3 * d + 2] * (d_running[d] + 1.0)
                                       + stall_weight * d_running[d] * d_rates[3 * d + 2]))
    n = P * D
    if n > 0:
        start_n = start % n
        if start_n < 0:
            start_n += n
        p = start_n // D
        d = start_n % D
        for i in range(n):
            c = buf_p[p] + xfer[p * D + d] * d_uncached[d] + buf_d[d] + handoff_s
            if c < best:
                best = c
                bp = p
                bd = d
            d += 1
            if d == D:
                d = 0
                p += 1
                if p == P:
                    p = 0
    if local and D > 0:
        start_d = start % D
        if start_d < 0:
            start_d += D
        for i in range(D):
            d = (start_d + i) % D
            dec = decode_tokens * (d_rates[3 * d] + d_rates[3 * d + 2] * (d_running[d] + 1.0)
                                   + stall_weight * d_running[d] * d_rates[3 * d + 2])
            c = (_ttft(d_queued[d] + d_uncached[d], d_running[d], &d_rates[3 * d],
                       chunk_tokens)
                 + stall_weight * d_running[d] * d_rates[3 * d + 1] * d_uncached[d] + dec)
            if c < lbest:
                lbest = c
                ld = d
    if buf_p != pbuf:
        free(buf_p)
    if ld >= 0 and lbest < best:
        out.p, out.d, out.cost, out.best, out.lbest = -1, ld, lbest, best, lbest
    elif bp >= 0:
        out.p, out.d, out.cost, out.best, out.lbest = bp, bd, best, best, lbest
    else:
        out.p, out.d, out.cost, out.best, out.lbest = -1, -1, INFINITY, INFINITY, INFINITY


def _check(name, Py_ssize_t got, Py_ssize_t want):
    if got != want:
        raise ValueError(f"{name} is expected to have {want} rows, got {got}")


def pick_pair(const double[::1] p_work, const double[::1] p_running,
              const double[:, ::1] p_rates, const double[::1] d_queued,
              const double[::1] d_uncached, const double[::1] d_running,
              const double[:, ::1] d_rates, const double[:, ::1] transfer_s_per_token,
              double decode_tokens=0.0, double chunk_tokens=8192.0, bint local=False,
              double stall_weight=0.0, Py_ssize_t start=0, p_uncached=None,
              double handoff_s=0.0):
    """The cheapest (prefill, decode) pair, or decode instance alone (module docstring).

    Parameters
    ----------
    p_work : float64[P]
        Per prefill instance: prefill tokens queued there + this request's tokens not
        cached there, tokens.
    p_running : float64[P]
        Sequences in each prefill instance's batch, requests.
    p_rates, d_rates : float64[P, 3], float64[D, 3], C-contiguous
        ``(step_s, prefill_s_per_token, decode_s_per_seq)`` per instance, seconds.
    d_queued : float64[D]
        Prefill tokens queued on each decode instance (its local prefills), tokens.
    d_uncached : float64[D]
        This request's prompt tokens not cached on each decode instance, tokens.
    d_running : float64[D]
        Sequences in each decode instance's batch, requests.
    transfer_s_per_token : float64[P, D], C-contiguous
        KV transfer time per token between each pair (its topology), seconds.
    decode_tokens : float
        Tokens this request will decode (its max_tokens), >= 0.
    chunk_tokens : float
        Prefill tokens one engine step computes at most, > 0.
    local : bool
        Whether a decode instance may serve the request alone (local prefill).
    stall_weight : float
        Weight of the delay this request imposes on each sequence running on ``d`` (its
        local prefill's steps, its own decode steps), >= 0.
    start : int
        Rotation of the tie-break.
    p_uncached : float64[P] or None
        This request's prompt tokens not cached on each prefill instance, tokens (the stall
        term of P); None = no stall term on P.
    handoff_s : float
        Seconds every pair costs beyond its terms (P's answer relayed, D's request for the
        KV; :class:`motor.coordinator.policy.pairs.PairChooser` learns it), >= 0.

    Returns
    -------
    (int, int, float, float, float)
        ``(p, d, cost_s, best_pair_s, best_local_s)``: ``p`` = -1 when ``d`` serves alone;
        ``(-1, -1, inf, inf, inf)`` when nothing can serve. ``best_local_s`` is ``inf``
        when ``local`` is false.

    Raises
    ------
    ValueError
        Arrays of mismatched lengths, ``chunk_tokens <= 0``, negative ``decode_tokens``,
        ``stall_weight`` or ``handoff_s``.
    """
    cdef Py_ssize_t P = p_work.shape[0]
    cdef Py_ssize_t D = d_queued.shape[0]
    _check("p_running", p_running.shape[0], P)
    _check("p_rates", p_rates.shape[0], P)
    _check("d_uncached", d_uncached.shape[0], D)
    _check("d_running", d_running.shape[0], D)
    _check("d_rates", d_rates.shape[0], D)
    if p_rates.shape[1] != 3 or d_rates.shape[1] != 3:
        raise ValueError("p_rates and d_rates are expected to have 3 columns")
    if transfer_s_per_token.shape[0] != P or transfer_s_per_token.shape[1] != D:
        raise ValueError(f"transfer_s_per_token is expected to have shape ({P}, {D}), got "
                         f"({transfer_s_per_token.shape[0]}, {transfer_s_per_token.shape[1]})")
    if not chunk_tokens > 0.0:
        raise ValueError(f"chunk_tokens is expected > 0, got {chunk_tokens}")
    if not (decode_tokens >= 0.0 and stall_weight >= 0.0 and handoff_s >= 0.0):
        raise ValueError("decode_tokens, stall_weight and handoff_s are expected >= 0")
    cdef const double[::1] p_unc
    cdef bint p_stall = p_uncached is not None and stall_weight > 0.0
    if p_uncached is not None:
        p_unc = p_uncached
        _check("p_uncached", p_unc.shape[0], P)
    cdef _Best b
    _pick(P, D, &p_work[0] if P else NULL, &p_running[0] if P else NULL,
          &p_rates[0, 0] if P else NULL, &d_queued[0] if D else NULL,
          &d_uncached[0] if D else NULL, &d_running[0] if D else NULL,
          &d_rates[0, 0] if D else NULL,
          &transfer_s_per_token[0, 0] if P and D else NULL, decode_tokens, chunk_tokens,
          local, stall_weight, start, &p_unc[0] if p_stall and P else NULL, handoff_s, &b)
    if b.p == -2:
        raise MemoryError()
    return b.p, b.d, b.cost, b.best, b.lbest


cdef const double *_f64(object a, str name, Py_ssize_t rows, Py_ssize_t cols) except NULL:
    """The data of ``a``: float64, C-contiguous, shape (rows,) (cols 0) or (rows, cols)."""
    if not isinstance(a, cnp.ndarray) or cnp.PyArray_TYPE(<cnp.ndarray>a) != cnp.NPY_FLOAT64:
        raise TypeError(f"{name} is expected to be a float64 numpy array")
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef bint ok = cnp.PyArray_IS_C_CONTIGUOUS(x) and (
        (cols == 0 and cnp.PyArray_NDIM(x) == 1 and cnp.PyArray_DIM(x, 0) == rows)
        or (cols > 0 and cnp.PyArray_NDIM(x) == 2 and cnp.PyArray_DIM(x, 0) == rows
            and cnp.PyArray_DIM(x, 1) == cols))
    if not ok:
        want = f"({rows},)" if cols == 0 else f"({rows}, {cols})"
        raise ValueError(f"{name} is expected to be C-contiguous of shape {want}, "
                         f"got {a.shape}")
    return <const double *>cnp.PyArray_DATA(x)


def pick_joint(Py_ssize_t n_prefill, object overlap, double prompt_tokens, double block_size,
               object tier_credit, object queued, object running, object rates,
               object transfer_s_per_token, double decode_tokens=0.0,
               double chunk_tokens=8192.0, bint local=False, double stall_weight=0.0,
               Py_ssize_t start=0, double handoff_s=0.0):
    """:func:`pick_pair` over the candidate columns of both roles, prefill instances first
    (``k = P + D`` rows, ``P = n_prefill``), with this request's uncached tokens computed
    as :func:`motor._fast.columns.uncached` does, in one pass: the same decision as
    ``uncached`` + :func:`pick_pair` on the columns' slices (``p_work = queued[:P] +
    uncached[:P]``, ``p_uncached = uncached[:P]``), without their arrays.

    Parameters
    ----------
    n_prefill : int
        ``P``, 0 <= P <= k: the first ``P`` rows are the prefill instances, the rest the
        decode instances.
    overlap : numpy.ndarray of int32, shape (k, 3), C-contiguous, or None
        Leading cached blocks per tier (:func:`motor._fast.columns.gather`'s); None:
        nothing cached (every candidate computes ``prompt_tokens``, share 0).
    prompt_tokens, block_size : float
        Tokens (>= 0), tokens per block (> 0).
    tier_credit : numpy.ndarray of float64, shape (3,)
        Share of a cached block's prefill saved per tier.
    queued, running : numpy.ndarray of float64, shape (k,), C-contiguous
        Prefill tokens queued (tokens) and sequences running (requests) per candidate.
    rates : numpy.ndarray of float64, shape (k, 3), C-contiguous
        ``(step_s, prefill_s_per_token, decode_s_per_seq)`` per candidate, seconds.
    transfer_s_per_token : numpy.ndarray of float64, shape (P, k - P), C-contiguous
        KV transfer seconds per token of each pair.
    decode_tokens, chunk_tokens, local, stall_weight, start, handoff_s
        As :func:`pick_pair` (the stall term of P always counts when ``stall_weight > 0``).

    Returns
    -------
    tuple
        ``(p, d, cost_s, best_pair_s, best_local_s, d_uncached, d_share, p_uncached,
        xfer_s_per_token)``: the first five as :func:`pick_pair`'s (``p``, ``d`` index the
        prefill / decode instances); then the chosen decode instance's uncached tokens and
        cached share of the prompt (0..1; 0.0 each when ``d`` = -1), the chosen prefill
        instance's uncached tokens and the pair's transfer seconds per token (0.0 each when
        ``p`` = -1).

    Raises
    ------
    TypeError
        An array of the wrong type or dtype.
    ValueError
        Wrong shapes or layout, ``n_prefill`` outside ``0..k``, ``block_size <= 0``,
        ``prompt_tokens < 0``, and :func:`pick_pair`'s.
    MemoryError
        No memory for the work columns.
    """
    cdef Py_ssize_t k, P = n_prefill, D, j
    cdef const int32_t *o = NULL
    cdef const double *c
    cdef const double *q
    cdef const double *ru
    cdef const double *ra
    cdef const double *x
    cdef cnp.ndarray ov
    cdef double saved, left, held, denom, d_share = 0.0, d_unc = 0.0, p_unc = 0.0, xs = 0.0
    cdef double ubuf[128]
    cdef double wbuf[64]
    cdef double *unc = ubuf
    cdef double *work = wbuf
    cdef _Best b
    if not block_size > 0.0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    if not prompt_tokens >= 0.0:
        raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
    if not isinstance(queued, cnp.ndarray):
        raise TypeError(f"queued is expected to be a float64 numpy array, got "
                        f"{type(queued).__name__}")
    k = cnp.PyArray_DIM(<cnp.ndarray>queued, 0) if cnp.PyArray_NDIM(<cnp.ndarray>queued) else -1
    if k < 0 or P < 0 or P > k:
        raise ValueError(f"n_prefill is expected to be in 0..{k}, got {P}")
    D = k - P
    q = _f64(queued, "queued", k, 0)
    ru = _f64(running, "running", k, 0)
    ra = _f64(rates, "rates", k, 3)
    x = _f64(transfer_s_per_token, "transfer_s_per_token", P, D)
    c = _f64(tier_credit, "tier_credit", 3, 0)
    if overlap is not None:
        if not isinstance(overlap, cnp.ndarray) or cnp.PyArray_TYPE(<cnp.ndarray>overlap) \
                != cnp.NPY_INT32:
            raise TypeError("overlap is expected to be an int32 numpy array or None")
        ov = <cnp.ndarray>overlap
        if (cnp.PyArray_NDIM(ov) != 2 or cnp.PyArray_DIM(ov, 0) != k
                or cnp.PyArray_DIM(ov, 1) != 3 or not cnp.PyArray_IS_C_CONTIGUOUS(ov)):
            raise ValueError(f"overlap is expected to be C-contiguous of shape ({k}, 3), "
                             f"got {overlap.shape}")
        o = <const int32_t *>cnp.PyArray_DATA(ov)
    if not chunk_tokens > 0.0:
        raise ValueError(f"chunk_tokens is expected > 0, got {chunk_tokens}")
    if not (decode_tokens >= 0.0 and stall_weight >= 0.0 and handoff_s >= 0.0):
        raise ValueError("decode_tokens, stall_weight and handoff_s are expected >= 0")
    if k > 128 or P > 64:
        unc = <double *> malloc((k + P + 1) * sizeof(double))
        if unc == NULL:
            raise MemoryError()
        work = unc + k
    try:
        with nogil:
            # columns.uncached's formula, row by row
            for j in range(k):
                if o == NULL:
                    unc[j] = prompt_tokens
                else:
                    saved = block_size * (c[0] * o[3 * j] + c[1] * o[3 * j + 1]
                                          + c[2] * o[3 * j + 2])
                    left = prompt_tokens - saved
                    unc[j] = left if left > 0.0 else 0.0
            for j in range(P):
                work[j] = q[j] + unc[j]
            _pick(P, D, work, ru, ra, q + P, unc + P, ru + P, ra + 3 * P, x, decode_tokens,
                  chunk_tokens, local, stall_weight, start,
                  unc if stall_weight > 0.0 else NULL, handoff_s, &b)
            if b.p != -2 and b.d >= 0:
                d_unc = unc[P + b.d]
                if o != NULL:
                    j = P + b.d
                    denom = prompt_tokens if prompt_tokens > 1.0 else 1.0
                    held = block_size * (<double>o[3 * j] + o[3 * j + 1] + o[3 * j + 2])
                    d_share = (held if held < prompt_tokens else prompt_tokens) / denom
            if b.p >= 0:
                p_unc = unc[b.p]
                xs = x[b.p * D + b.d]
    finally:
        if unc != ubuf:
            free(unc)
    if b.p == -2:
        raise MemoryError()
    return b.p, b.d, b.cost, b.best, b.lbest, d_unc, d_share, p_unc, xs
