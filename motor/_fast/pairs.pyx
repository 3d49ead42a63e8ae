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
from libc.stdlib cimport free, malloc


cdef inline double _ttft(double work, double running, const double *r,
                         double chunk) noexcept nogil:
    cdef double steps = ceil(work / chunk)
    if steps < 1.0:
        steps = 1.0
    return steps * (r[0] + r[2] * running) + r[1] * work


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
    cdef Py_ssize_t n, i, j, p, d, bp = -1, bd = -1, ld = -1, start_n, start_d
    cdef double c, best = INFINITY, lbest = INFINITY, dec
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
    cdef double *buf = <double *> malloc((P + D + 1) * sizeof(double))
    if buf == NULL:
        raise MemoryError()
    try:
        with nogil:
            # per prefill instance its prefill, per decode instance its first step + decode
            for p in range(P):
                buf[p] = _ttft(p_work[p], p_running[p], &p_rates[p, 0], chunk_tokens)
                if p_stall:
                    buf[p] = buf[p] + stall_weight * p_running[p] * p_rates[p, 1] * p_unc[p]
            for d in range(D):
                buf[P + d] = ((d_rates[d, 0] + d_rates[d, 2] * d_running[d]
                               + d_rates[d, 1] * d_queued[d])
                              + decode_tokens * (d_rates[d, 0]
                                                 + d_rates[d, 2] * (d_running[d] + 1.0)
                                                 + stall_weight * d_running[d] * d_rates[d, 2]))
            n = P * D
            if n > 0:
                start_n = start % n
                if start_n < 0:
                    start_n += n
                p = start_n // D
                d = start_n % D
                for i in range(n):
                    c = (buf[p] + transfer_s_per_token[p, d] * d_uncached[d] + buf[P + d]
                         + handoff_s)
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
                    dec = decode_tokens * (d_rates[d, 0] + d_rates[d, 2] * (d_running[d] + 1.0)
                                           + stall_weight * d_running[d] * d_rates[d, 2])
                    c = (_ttft(d_queued[d] + d_uncached[d], d_running[d], &d_rates[d, 0],
                               chunk_tokens)
                         + stall_weight * d_running[d] * d_rates[d, 1] * d_uncached[d] + dec)
                    if c < lbest:
                        lbest = c
                        ld = d
    finally:
        free(buf)
    if ld >= 0 and lbest < best:
        return -1, ld, lbest, best, lbest
    if bp >= 0:
        return bp, bd, best, best, lbest
    return -1, -1, INFINITY, INFINITY, INFINITY
