# cython: language_level=3
"""C-level API of ``motor._fast.scoring`` (see scoring.pyx)."""
from libc.stdint cimport int32_t, int64_t

cimport numpy as cnp

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
    double guard_min_load            # the guard acts only when some load is above this
    Py_ssize_t favored               # instance index given a credit (session), -1: none
    double favored_credit            # prompt-token equivalents off the favored one's cost


cdef struct ScoreInputs:
    const int32_t *overlap           # [n, 3]
    const double *prefill_tokens     # [n]
    const double *decode_tokens      # [n]
    const double *queue              # [n]
    Py_ssize_t n
    const int32_t *cand32            # candidates (one of cand32 / cand64 / none)
    const int64_t *cand64
    Py_ssize_t k                     # number of candidates


cdef enum:
    TTFT_N_RATES = 3                 # columns of the rates array (see TtftInputs.rates)


cdef struct TtftInputs:
    const int32_t *overlap           # [n, 3]
    const double *queued_tokens      # [n] prefill tokens queued ahead of the request, tokens
    const double *running            # [n] sequences in the instance's batch
    const double *rates              # [n, 3] step s, s per prefill token, s per sequence-step
    Py_ssize_t n
    const int32_t *cand32
    const int64_t *cand64
    Py_ssize_t k
    double prompt_tokens
    double chunk_tokens              # prefill tokens per engine step (chunked prefill budget)
    double saved_per_block[SCORING_N_TIERS]   # block_size * tier credit
    Py_ssize_t favored               # instance index given a credit (session), -1: none
    double favored_credit            # seconds off the favored one's predicted TTFT
    double stall_weight              # weight of running[i] x the request's prefill time


# Predicted TTFT (seconds) per candidate into ttft[k] (may be NULL); returns the position
# of the argmin, -1 when k == 0. Ties: lowest TTFT, then lowest queued time, then first
# from ``start``.
cdef Py_ssize_t ttft_ptr(const TtftInputs *x, Py_ssize_t start, double *ttft,
                         double *best_ttft) noexcept nogil


# Fill costs[k] (may be NULL); return the position (in candidates) of the best one,
# -1 when k == 0. Ties: lowest cost, then lowest load, then first from ``start``.
cdef Py_ssize_t score_ptr(const ScoreParams *p, const ScoreInputs *x, Py_ssize_t start,
                          double *costs, double *best_cost) noexcept nogil


# The data of ``arr``, checked to be a C-contiguous float64 numpy array of shape (n,); errors
# name it ``name`` (TypeError: not such an array or dtype; ValueError: shape or layout).
cdef inline const double *f64_column(object arr, str name, Py_ssize_t n) except NULL:
    cdef cnp.ndarray a
    if not isinstance(arr, cnp.ndarray):
        raise TypeError(f"{name} is expected to be a numpy float64 array, "
                        f"got {type(arr).__name__}")
    a = <cnp.ndarray>arr
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT64:
        raise TypeError(f"{name} is expected to have dtype float64, got {arr.dtype}")
    if cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_DIM(a, 0) != n:
        raise ValueError(f"{name} is expected to have shape ({n},), got {arr.shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{name} is expected to be C-contiguous")
    return <const double *>cnp.PyArray_DATA(a)
