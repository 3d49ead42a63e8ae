# cython: language_level=3
"""Cost of sending a request to each candidate instance, and the argmin.

For candidate instance ``i`` (all quantities in prefill-token equivalents)::

    saved_i  = block_size * sum_t tier_credit[t] * overlap[i, t]
    load_i   = w_prefill * prefill_tokens[i] + w_decode * decode_tokens[i]
               + w_queue * queue[i]
    saved_i  = 0                if guard_factor > 0 and k > 1
                                and max_j load_j > guard_min_load
                                and load_i > guard_factor * mean(load_j, j != i)
    cost_i   = max(prompt_tokens - saved_i, 0) + load_i

``overlap`` is :meth:`motor._fast.radix.PrefixIndex.match` output (leading cached
blocks per instance and fastest tier); the guard's mean is over the *other* candidates
(computed as the one threshold ``load_i > guard_factor * sum(load) / (k - 1 +
guard_factor)``, the same inequality)
(with the candidate itself in the mean, two candidates could never trip it: load_A >
2 x (load_A + load_B) / 2 is impossible; case N07). The load guard stops a hot cache
holder from taking every request: above the guard its cached prefix is ignored and it
competes on load alone.

Tie-break (deterministic): lowest cost, then lowest load, then the first
candidate in rotation order starting at position ``start % k`` of the candidate
list; ``start=0`` gives the lowest position, a moving ``start`` gives round robin
among equals.

:func:`pick_ttft` prices the same choice in **time** (seconds of predicted TTFT), with
per-instance rates (``rates[i] = (step_s, prefill_s_per_token, decode_s_per_seq)``,
learned by :class:`motor.coordinator.policy.ttft.RateModel`)::

    uncached_i = max(prompt_tokens - saved_i, 0)                         tokens
    work_i     = queued_tokens[i] + uncached_i                           tokens
    steps_i    = max(1, ceil(work_i / chunk_tokens))                     engine steps
    ttft_i     = steps_i * (step_s[i] + decode_s_per_seq[i] * running[i])   seconds
                 + prefill_s_per_token[i] * work_i

(the request's prefill waits behind the prefill work queued on ``i`` and runs in
``steps_i`` chunked steps, each paying the fixed step cost and the decode batch).
The candidates are compared on ``ttft_i + stall_weight * running[i] *
prefill_s_per_token[i] * uncached_i``: the request's own TTFT plus the time its prefill
holds up the ``running[i]`` sequences already in ``i``'s batch (their next token waits for
the step that carries it). Without that term a request with nothing cached anywhere (a
conversation's first turn) goes to whichever instance's rates are a little faster, and its
later turns follow their cache there; with it, to the instance with the fewest sequences.
The value returned (and written to ``out``) is ``ttft_i`` alone.
Tie-break: lowest compared value, then lowest queued time ``prefill_s_per_token[i] *
queued_tokens[i] + decode_s_per_seq[i] * running[i]``, then rotation from ``start``.

Session affinity (both costs): one ``favored`` instance may get a bounded credit
(``favored_credit``: prompt-token equivalents for :func:`pick`, seconds for
:func:`pick_ttft`) taken off its cost for the comparison only; the cost returned and
written to ``out`` is always the uncredited one.
"""
from libc.stdint cimport int32_t, int64_t
from libc.math cimport INFINITY, ceil

cimport numpy as cnp
import numpy as np

from motor._fast._common cimport MOTOR_DEBUG

cnp.import_array()

#: True when compiled with ``-DMOTOR_DEBUG=1``.
DEBUG = bool(MOTOR_DEBUG)


cdef inline Py_ssize_t _position(const int32_t *c32, const int64_t *c64, Py_ssize_t k,
                                 Py_ssize_t inst) noexcept nogil:
    """Position of instance ``inst`` among the candidates, -1 when it is none of them."""
    cdef Py_ssize_t j
    if c32 == NULL and c64 == NULL:
        return inst if 0 <= inst < k else -1
    for j in range(k):
        if (c32[j] if c32 != NULL else c64[j]) == inst:
            return j
    return -1


cdef inline bint _rotates_first(Py_ssize_t a, Py_ssize_t b, Py_ssize_t start,
                                Py_ssize_t k) noexcept nogil:
    """Whether position ``a`` comes before ``b`` in the rotation from ``start``."""
    return (a - start + k) % k < (b - start + k) % k


cdef inline double _load_of(const ScoreParams *p, const ScoreInputs *x,
                           Py_ssize_t i) noexcept nogil:
    """Weighted load of instance ``i`` (prefill and decode tokens in flight, queue)."""
    return (p.w_prefill * x.prefill_tokens[i] + p.w_decode * x.decode_tokens[i]
            + p.w_queue * x.queue[i])


cdef inline double _cost_of(const ScoreParams *p, const ScoreInputs *x, Py_ssize_t i,
                           double guard, double bs0, double bs1, double bs2,
                           double *load) noexcept nogil:
    """Token cost of instance ``i``: uncached prompt tokens (no credit above the load guard)
    + its load; ``load[0]``: the load."""
    cdef const int32_t *ov = x.overlap + 3 * i
    cdef double saved, left
    load[0] = _load_of(p, x, i)
    saved = bs0 * ov[0] + bs1 * ov[1] + bs2 * ov[2]
    if load[0] > guard:
        saved = 0.0
    left = p.prompt_tokens - saved
    if left < 0.0:
        left = 0.0
    return left + load[0]


cdef Py_ssize_t score_ptr(const ScoreParams *p, const ScoreInputs *x, Py_ssize_t start,
                          double *costs, double *best_cost) noexcept nogil:
    cdef Py_ssize_t pos, q, i, best = -1
    cdef double load, cost, total = 0.0, guard = INFINITY, top = -INFINITY
    cdef double best_c = INFINITY, best_l = INFINITY
    cdef double bs0 = p.block_size * p.credit[0]
    cdef double bs1 = p.block_size * p.credit[1]
    cdef double bs2 = p.block_size * p.credit[2]
    if x.k <= 0:
        best_cost[0] = INFINITY
        return -1
    if p.guard_factor > 0.0 and x.k > 1:
        for pos in range(x.k):
            i = x.cand32[pos] if x.cand32 != NULL else (
                x.cand64[pos] if x.cand64 != NULL else pos)
            load = _load_of(p, x, i)
            total += load
            if load > top:
                top = load
        # load_i > g * (total - load_i) / (k - 1)  <=>  load_i > g * total / (k - 1 + g):
        # one threshold for every candidate (none while every load is light)
        if top > p.guard_min_load:
            guard = p.guard_factor * total / (x.k - 1 + p.guard_factor)
    start = start % x.k
    if start < 0:
        start += x.k
    for q in range(x.k):
        pos = start + q
        if pos >= x.k:
            pos -= x.k
        i = x.cand32[pos] if x.cand32 != NULL else (
            x.cand64[pos] if x.cand64 != NULL else pos)
        cost = _cost_of(p, x, i, guard, bs0, bs1, bs2, &load)
        if costs != NULL:
            costs[pos] = cost
        if cost < best_c or (cost == best_c and load < best_l):
            best_c = cost
            best_l = load
            best = pos
    if p.favored >= 0 and p.favored_credit > 0.0:
        # only the favored one's value moved (down): it is the argmin, or the argmin stays
        pos = _position(x.cand32, x.cand64, x.k, p.favored)
        if pos >= 0 and pos != best:
            cost = _cost_of(p, x, p.favored, guard, bs0, bs1, bs2, &load)
            if (cost - p.favored_credit < best_c or (cost - p.favored_credit == best_c and (
                    load < best_l or (load == best_l and _rotates_first(pos, best, start,
                                                                        x.k))))):
                best_c = cost
                best = pos
    best_cost[0] = best_c
    return best


cdef int _prepare(ScoreParams *p, ScoreInputs *x, object overlap, Py_ssize_t prompt_tokens,
                  Py_ssize_t block_size, object tier_credit, object prefill_tokens,
                  object decode_tokens, object queue, object candidates, double w_prefill,
                  double w_decode, double w_queue, double guard_factor,
                  Py_ssize_t favored=-1, double favored_credit=0.0,
                  double guard_min_load=0.0) except -1:
    cdef cnp.ndarray ov, cand
    cdef const double *credit
    cdef Py_ssize_t n, j, v
    cdef int t
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
    if not isinstance(overlap, cnp.ndarray):
        raise TypeError(f"overlap is expected to be a numpy int32 array, "
                        f"got {type(overlap).__name__}")
    ov = <cnp.ndarray>overlap
    if cnp.PyArray_TYPE(ov) != cnp.NPY_INT32:
        raise TypeError(f"overlap is expected to have dtype int32, got {overlap.dtype}")
    if (cnp.PyArray_NDIM(ov) != 2 or cnp.PyArray_DIM(ov, 1) != SCORING_N_TIERS
            or not cnp.PyArray_IS_C_CONTIGUOUS(ov)):
        raise ValueError(f"overlap is expected to be C-contiguous with shape (n, 3), "
                         f"got {overlap.shape}")
    n = cnp.PyArray_DIM(ov, 0)
    credit = f64_column(tier_credit, "tier_credit", SCORING_N_TIERS)
    x.overlap = <const int32_t *>cnp.PyArray_DATA(ov)
    x.prefill_tokens = f64_column(prefill_tokens, "prefill_tokens", n)
    x.decode_tokens = f64_column(decode_tokens, "decode_tokens", n)
    x.queue = f64_column(queue, "queue", n)
    x.n = n
    x.cand32 = NULL
    x.cand64 = NULL
    if candidates is None:
        x.k = n
    else:
        if not isinstance(candidates, cnp.ndarray):
            raise TypeError(f"candidates is expected to be a numpy int32/int64 array, "
                            f"got {type(candidates).__name__}")
        cand = <cnp.ndarray>candidates
        if cnp.PyArray_NDIM(cand) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(cand):
            raise ValueError(f"candidates is expected to be 1-D and C-contiguous, "
                             f"got shape {candidates.shape}")
        x.k = cnp.PyArray_DIM(cand, 0)
        if cnp.PyArray_TYPE(cand) == cnp.NPY_INT32:
            x.cand32 = <const int32_t *>cnp.PyArray_DATA(cand)
        elif cnp.PyArray_TYPE(cand) == cnp.NPY_INT64:
            x.cand64 = <const int64_t *>cnp.PyArray_DATA(cand)
        else:
            raise TypeError(f"candidates is expected to have dtype int32 or int64, "
                            f"got {candidates.dtype}")
        for j in range(x.k):
            v = x.cand32[j] if x.cand32 != NULL else x.cand64[j]
            if v < 0 or v >= n:
                raise ValueError(f"candidates[{j}] is expected to be in 0..{n - 1}, got {v}")
    p.prompt_tokens = <double>prompt_tokens
    p.block_size = <double>block_size
    for t in range(SCORING_N_TIERS):
        p.credit[t] = credit[t]
    p.w_prefill = w_prefill
    p.w_decode = w_decode
    p.w_queue = w_queue
    p.guard_factor = guard_factor
    p.guard_min_load = guard_min_load
    p.favored = favored
    p.favored_credit = favored_credit
    return 0


def pick(overlap, Py_ssize_t prompt_tokens, Py_ssize_t block_size, tier_credit,
         prefill_tokens, decode_tokens, queue, candidates=None, double w_prefill=1.0,
         double w_decode=0.0, double w_queue=0.0, double guard_factor=0.0,
         Py_ssize_t start=0, Py_ssize_t favored=-1, double favored_credit=0.0,
         double guard_min_load=0.0):
    """Cheapest candidate for a request (see the module docstring for the cost).

    Parameters
    ----------
    overlap : numpy.ndarray of int32, shape (n, 3), C-contiguous
        Leading cached blocks per instance and fastest tier (``PrefixIndex.match``).
    prompt_tokens : int
        Prompt length in tokens, >= 0.
    block_size : int
        Tokens per block, > 0.
    tier_credit : numpy.ndarray of float64, shape (3,)
        Fraction of a cached block's prefill saved, per tier (device, host, disk),
        e.g. ``[1.0, 0.8, 0.5]``.
    prefill_tokens, decode_tokens, queue : numpy.ndarray of float64, shape (n,)
        Per-instance load: in-flight prefill tokens, in-flight decode tokens
        (or running sequences), waiting requests.
    candidates : numpy.ndarray of int32 or int64, shape (k,), optional
        Eligible instance indices (0..n-1), in tie-break order; None = all n.
    w_prefill, w_decode, w_queue : float, optional
        Weights of the load terms (defaults 1, 0, 0), in prefill tokens per unit.
    guard_factor : float, optional
        > 0: an instance whose load exceeds ``guard_factor`` x the mean load of the
        other candidates gets no cache credit. 0 (default) disables the guard.
    start : int, optional
        Rotation offset for the last tie-break (position in ``candidates``).
    favored, favored_credit : int, float, optional
        Instance index (0..n-1; -1 = none, the default) whose cost is lowered by
        ``favored_credit`` prompt-token equivalents for the comparison only (session
        affinity: a soft preference, bounded by the credit).
    guard_min_load : float, optional
        The guard acts only when some candidate's load is above this (prefill-token
        equivalents; default 0): under light load every cached prefix counts.

    Returns
    -------
    (int, float)
        The chosen instance index (an element of ``candidates``) and its cost in
        prefill-token equivalents (without the credit); ``(-1, inf)`` when there is no
        candidate.

    Raises
    ------
    TypeError
        An array of the wrong type or dtype.
    ValueError
        Wrong shapes, non-contiguous arrays, a candidate outside 0..n-1,
        ``block_size <= 0`` or ``prompt_tokens < 0``.
    """
    cdef ScoreParams p
    cdef ScoreInputs x
    cdef double best_cost
    cdef Py_ssize_t pos
    _prepare(&p, &x, overlap, prompt_tokens, block_size, tier_credit, prefill_tokens,
             decode_tokens, queue, candidates, w_prefill, w_decode, w_queue, guard_factor,
             favored, favored_credit, guard_min_load)
    pos = score_ptr(&p, &x, start, NULL, &best_cost)
    if pos < 0:
        return -1, best_cost
    if x.cand32 != NULL:
        return <Py_ssize_t>x.cand32[pos], best_cost
    if x.cand64 != NULL:
        return <Py_ssize_t>x.cand64[pos], best_cost
    return pos, best_cost


def costs(overlap, Py_ssize_t prompt_tokens, Py_ssize_t block_size, tier_credit,
          prefill_tokens, decode_tokens, queue, out, candidates=None,
          double w_prefill=1.0, double w_decode=0.0, double w_queue=0.0,
          double guard_factor=0.0, Py_ssize_t start=0):
    """Each candidate's cost into ``out``; returns the chosen position.

    Same parameters as :func:`pick`, plus ``out``: numpy float64 array of shape
    (k,) (k = number of candidates, or n), filled with ``out[pos]`` = cost of
    ``candidates[pos]``.

    Returns
    -------
    int
        Position in ``candidates`` (not the instance index) of the cheapest
        candidate under the tie-break, -1 when k == 0.
    """
    cdef ScoreParams p
    cdef ScoreInputs x
    cdef double best_cost
    cdef cnp.ndarray o
    _prepare(&p, &x, overlap, prompt_tokens, block_size, tier_credit, prefill_tokens,
             decode_tokens, queue, candidates, w_prefill, w_decode, w_queue, guard_factor)
    if not isinstance(out, cnp.ndarray):
        raise TypeError(f"out is expected to be a numpy float64 array, got {type(out).__name__}")
    o = <cnp.ndarray>out
    if cnp.PyArray_TYPE(o) != cnp.NPY_FLOAT64:
        raise TypeError(f"out is expected to have dtype float64, got {out.dtype}")
    if (cnp.PyArray_NDIM(o) != 1 or cnp.PyArray_DIM(o, 0) != x.k
            or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISWRITEABLE(o)):
        raise ValueError(f"out is expected to be a writeable C-contiguous array of shape "
                         f"({x.k},), got {out.shape}")
    return score_ptr(&p, &x, start, <double *>cnp.PyArray_DATA(o), &best_cost)


# ------------------------------------------------------------------ time-based cost

cdef inline double _ttft_of(const TtftInputs *x, Py_ssize_t i, double *compared) noexcept nogil:
    """Predicted TTFT (s) of instance ``i``; ``compared[0]``: it plus the stall term."""
    cdef const int32_t *ov = x.overlap + 3 * i
    cdef const double *r = x.rates + TTFT_N_RATES * i
    cdef double unc, work, steps, t
    unc = x.prompt_tokens - (x.saved_per_block[0] * ov[0] + x.saved_per_block[1] * ov[1]
                             + x.saved_per_block[2] * ov[2])
    if unc < 0.0:
        unc = 0.0
    work = x.queued_tokens[i] + unc
    steps = ceil(work / x.chunk_tokens)
    if steps < 1.0:
        steps = 1.0
    t = steps * (r[0] + r[2] * x.running[i]) + r[1] * work
    compared[0] = t + x.stall_weight * x.running[i] * r[1] * unc
    return t


cdef Py_ssize_t ttft_ptr(const TtftInputs *x, Py_ssize_t start, double *ttft,
                         double *best_ttft) noexcept nogil:
    cdef Py_ssize_t pos, q, i, best = -1
    cdef double t, eff, queued_t, best_t = INFINITY, best_q = INFINITY, best_real = INFINITY
    cdef const double *r
    if x.k <= 0:
        best_ttft[0] = INFINITY
        return -1
    start = start % x.k
    if start < 0:
        start += x.k
    for q in range(x.k):
        pos = start + q
        if pos >= x.k:
            pos -= x.k
        i = x.cand32[pos] if x.cand32 != NULL else (
            x.cand64[pos] if x.cand64 != NULL else pos)
        t = _ttft_of(x, i, &eff)
        if ttft != NULL:
            ttft[pos] = t
        if eff <= best_t:
            r = x.rates + TTFT_N_RATES * i
            queued_t = r[1] * x.queued_tokens[i] + r[2] * x.running[i]
            if eff < best_t or queued_t < best_q:
                best_t = eff
                best_q = queued_t
                best_real = t
                best = pos
    if x.favored >= 0 and x.favored_credit > 0.0:
        # only the favored one's value moved (down): it is the argmin, or the argmin stays
        pos = _position(x.cand32, x.cand64, x.k, x.favored)
        if pos >= 0 and pos != best:
            i = x.favored
            t = _ttft_of(x, i, &eff)
            eff -= x.favored_credit
            r = x.rates + TTFT_N_RATES * i
            queued_t = r[1] * x.queued_tokens[i] + r[2] * x.running[i]
            if eff < best_t or (eff == best_t and (
                    queued_t < best_q or (queued_t == best_q and _rotates_first(
                        pos, best, start, x.k)))):
                best_real = t
                best = pos
    best_ttft[0] = best_real
    return best


cdef int _prepare_ttft(TtftInputs *x, object overlap, Py_ssize_t prompt_tokens,
                       Py_ssize_t block_size, object tier_credit, object queued_tokens,
                       object running, object rates, object candidates,
                       double chunk_tokens, Py_ssize_t favored=-1,
                       double favored_credit=0.0, double stall_weight=0.0) except -1:
    cdef ScoreParams p
    cdef ScoreInputs s
    cdef cnp.ndarray rt
    cdef int t
    if not chunk_tokens > 0.0:
        raise ValueError(f"chunk_tokens is expected to be > 0, got {chunk_tokens}")
    if not stall_weight >= 0.0:
        raise ValueError(f"stall_weight is expected to be >= 0, got {stall_weight}")
    if isinstance(overlap, cnp.ndarray) and cnp.PyArray_NDIM(<cnp.ndarray>overlap) == 2:
        # named checks of our own columns before the shared ones (overlap, credit, candidates)
        f64_column(queued_tokens, "queued_tokens", cnp.PyArray_DIM(<cnp.ndarray>overlap, 0))
        f64_column(running, "running", cnp.PyArray_DIM(<cnp.ndarray>overlap, 0))
    _prepare(&p, &s, overlap, prompt_tokens, block_size, tier_credit, queued_tokens,
             running, running, candidates, 0.0, 0.0, 0.0, 0.0)
    if not isinstance(rates, cnp.ndarray):
        raise TypeError(f"rates is expected to be a numpy float64 array, "
                        f"got {type(rates).__name__}")
    rt = <cnp.ndarray>rates
    if cnp.PyArray_TYPE(rt) != cnp.NPY_FLOAT64:
        raise TypeError(f"rates is expected to have dtype float64, got {rates.dtype}")
    if (cnp.PyArray_NDIM(rt) != 2 or cnp.PyArray_DIM(rt, 0) != s.n
            or cnp.PyArray_DIM(rt, 1) != TTFT_N_RATES or not cnp.PyArray_IS_C_CONTIGUOUS(rt)):
        raise ValueError(f"rates is expected to be C-contiguous with shape ({s.n}, 3), "
                         f"got {rates.shape}")
    x.overlap = s.overlap
    x.queued_tokens = s.prefill_tokens
    x.running = s.decode_tokens
    x.rates = <const double *>cnp.PyArray_DATA(rt)
    x.n = s.n
    x.cand32 = s.cand32
    x.cand64 = s.cand64
    x.k = s.k
    x.prompt_tokens = p.prompt_tokens
    x.chunk_tokens = chunk_tokens
    x.favored = favored
    x.favored_credit = favored_credit
    x.stall_weight = stall_weight
    for t in range(SCORING_N_TIERS):
        x.saved_per_block[t] = p.block_size * p.credit[t]
    return 0


def pick_ttft(overlap, Py_ssize_t prompt_tokens, Py_ssize_t block_size, tier_credit,
              queued_tokens, running, rates, candidates=None, double chunk_tokens=8192.0,
              Py_ssize_t start=0, out=None, Py_ssize_t favored=-1,
              double favored_credit=0.0, double stall_weight=0.0):
    """Candidate with the lowest predicted TTFT (see the module docstring for the model).

    Parameters
    ----------
    overlap : numpy.ndarray of int32, shape (n, 3), C-contiguous
        Leading cached blocks per instance and fastest tier (``PrefixIndex.match``).
    prompt_tokens : int
        Prompt length in tokens, >= 0.
    block_size : int
        Tokens per block, > 0.
    tier_credit : numpy.ndarray of float64, shape (3,)
        Fraction of a cached block's prefill saved, per tier (device, host, disk).
    queued_tokens : numpy.ndarray of float64, shape (n,)
        Prefill tokens queued on each instance ahead of this request, tokens.
    running : numpy.ndarray of float64, shape (n,)
        Sequences in each instance's batch (decoding or waiting), requests.
    rates : numpy.ndarray of float64, shape (n, 3), C-contiguous
        Per instance: fixed step time (s), prefill time per token (s/token), decode time
        per sequence in a step (s/sequence).
    candidates : numpy.ndarray of int32 or int64, shape (k,), optional
        Eligible instance indices (0..n-1), in tie-break order; None = all n.
    chunk_tokens : float, optional
        Prefill tokens one engine step computes at most (chunked prefill budget, vLLM's
        ``max_num_batched_tokens``), > 0; default 8192.
    start : int, optional
        Rotation offset for the last tie-break (position in ``candidates``).
    out : numpy.ndarray of float64, shape (k,), optional
        Filled with each candidate's predicted TTFT in seconds, in candidate order.
    favored, favored_credit : int, float, optional
        Instance index (0..n-1; -1 = none, the default) whose predicted TTFT is lowered
        by ``favored_credit`` seconds for the comparison only (session affinity).
    stall_weight : float, optional
        >= 0 (default 0): each candidate is compared at its TTFT plus ``stall_weight`` x
        ``running[i]`` x ``prefill_s_per_token[i]`` x the request's uncached tokens, the
        time its prefill holds up the sequences already in ``i``'s batch (see the module
        docstring).

    Returns
    -------
    (int, float)
        The chosen instance index (an element of ``candidates``) and its predicted TTFT
        in seconds (without the credit); ``(-1, inf)`` when there is no candidate.

    Raises
    ------
    TypeError
        An array of the wrong type or dtype.
    ValueError
        Wrong shapes, non-contiguous arrays, a candidate outside 0..n-1,
        ``block_size <= 0``, ``prompt_tokens < 0`` or ``chunk_tokens <= 0``.
    """
    cdef TtftInputs x
    cdef double best
    cdef double *o = NULL
    cdef cnp.ndarray oa
    cdef Py_ssize_t pos
    _prepare_ttft(&x, overlap, prompt_tokens, block_size, tier_credit, queued_tokens,
                  running, rates, candidates, chunk_tokens, favored, favored_credit,
                  stall_weight)
    if out is not None:
        if not isinstance(out, cnp.ndarray):
            raise TypeError(f"out is expected to be a numpy float64 array, "
                            f"got {type(out).__name__}")
        oa = <cnp.ndarray>out
        if cnp.PyArray_TYPE(oa) != cnp.NPY_FLOAT64:
            raise TypeError(f"out is expected to have dtype float64, got {out.dtype}")
        if (cnp.PyArray_NDIM(oa) != 1 or cnp.PyArray_DIM(oa, 0) != x.k
                or not cnp.PyArray_IS_C_CONTIGUOUS(oa) or not cnp.PyArray_ISWRITEABLE(oa)):
            raise ValueError(f"out is expected to be a writeable C-contiguous array of shape "
                             f"({x.k},), got {out.shape}")
        o = <double *>cnp.PyArray_DATA(oa)
    pos = ttft_ptr(&x, start, o, &best)
    if pos < 0:
        return -1, best
    if x.cand32 != NULL:
        return <Py_ssize_t>x.cand32[pos], best
    if x.cand64 != NULL:
        return <Py_ssize_t>x.cand64[pos], best
    return pos, best
