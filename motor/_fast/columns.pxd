# cython: language_level=3
"""C-level API of ``motor._fast.columns`` (see columns.pyx)."""
from libc.stdint cimport int32_t

cimport numpy as cnp


# Slots, cached-block rows and (``ld`` not NULL) local loads of each candidate into
# caller-owned arrays; returns how many candidates have no slot (see columns.pyx).
cdef Py_ssize_t gather_ptr(list cands, dict slot_of, const int32_t *m, Py_ssize_t n_slots,
                           object favored_key, cnp.intp_t *sl, int32_t *ov, double *ld,
                           Py_ssize_t *favored) except -1
