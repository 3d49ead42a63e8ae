# cython: language_level=3
"""C-level API of ``motor._fast.scoring`` (see scoring.pyx)."""
from libc.stdint cimport int32_t, int64_t

cdef enum:
    SCORING_N_TIERS = 3


cdef struct ScoreParams:
    double prompt_tokens
    double block_size
    double credit[SCORING_N_TIERS]   # fraction of a cached block's tokens saved, per tier
    double w_prefill                 # weight of in-flight prefill tokens
    double w_decode                  # weight of in-flight decode tokens
    double w_queue                   # weight of waiting requests
    double guard_factor              # <= 0: no load guard


cdef struct ScoreInputs:
    const int32_t *overlap           # [n, 3]
    const double *prefill_tokens     # [n]
    const double *decode_tokens      # [n]
    const double *queue              # [n]
    Py_ssize_t n
    const int32_t *cand32            # candidates (one of cand32 / cand64 / none)
    const int64_t *cand64
    Py_ssize_t k                     # number of candidates


# Fill costs[k] (may be NULL); return the position (in candidates) of the best one,
# -1 when k == 0. Ties: lowest cost, then lowest load, then first from ``start``.
cdef Py_ssize_t score_ptr(const ScoreParams *p, const ScoreInputs *x, Py_ssize_t start,
                          double *costs, double *best_cost) noexcept nogil
