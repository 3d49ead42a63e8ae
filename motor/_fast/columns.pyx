# cython: language_level=3
"""The per-candidate columns of one routing decision, gathered in one compiled pass.

A KV-aware policy compares ``k`` candidate endpoints on a few numbers each: the endpoint's
slot in the KV indexes, its leading cached blocks per tier (its slot's row of
:meth:`motor._fast.radix.PrefixIndex.match`'s output) and the load this process has in
flight on it (the endpoint's ``inflight_prefill_tokens``, ``inflight_decode_tokens`` and
``inflight`` counters). Read with generator expressions into ``numpy.fromiter`` they cost
about 70 ns an endpoint and value (12 us for 64 candidates, more than the prefix match of a
32k-token prompt); read here, attribute by attribute from C, a few ns each.

Nothing here decides anything: :func:`gather` only copies. The endpoints may be any objects
with a ``key`` (str) and, when ``local_loads`` is true, the three counters (ints or floats).

Attributes that are ``__slots__`` members (``EndpointState``'s) are read at their byte offset
in the object: the offsets are looked up once per type (the member descriptors the type's
attribute lookup finds; :mod:`motor._fast.slots`) and kept while the type is unchanged (its
version tag, which CPython clears on any change of the type or its bases). Any other
object, a type with its own ``__getattribute__`` or ``__setattr__``, or a slot left unset,
goes through the ordinary attribute read.
"""
from cpython.dict cimport PyDict_GetItemWithError
from cpython.float cimport PyFloat_AsDouble
from cpython.long cimport PyLong_AsDouble, PyLong_CheckExact
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyTypeObject, Py_TYPE
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t

cimport numpy as cnp

cnp.import_array()

from motor._fast.slots cimport motor_member_offset as col_member_offset
from motor._fast.slots cimport motor_slot as col_slot
from motor._fast.slots cimport motor_type_tag as col_type_tag

#: the endpoint attributes gather reads, in the order of the offsets below
cdef enum:
    A_KEY = 0
    A_PREFILL = 1
    A_DECODE = 2
    A_INFLIGHT = 3
    N_ATTRS = 4

cdef tuple _names = ("key", "inflight_prefill_tokens", "inflight_decode_tokens", "inflight")
#: the last type read and its version tag (0: none), the attributes' slot offsets (-1: not
#: a slot). The type is not referenced: a tag is never given to two types.
cdef PyTypeObject *_seen_type = NULL
cdef unsigned int _seen_tag = 0
cdef Py_ssize_t _offsets[N_ATTRS]


cdef int _learn_type(PyTypeObject *tp) except -1:
    """Look up the attributes' slot offsets of ``tp`` (:data:`_offsets`)."""
    global _seen_type, _seen_tag
    cdef int i
    _seen_tag = 0
    for i in range(N_ATTRS):
        _offsets[i] = col_member_offset(tp, _names[i])
    _seen_type = tp
    _seen_tag = col_type_tag(tp)     # after the lookups, which assign a tag when none
    return 0


cdef inline object _attr(object e, int i):
    """Attribute ``_names[i]`` of ``e``, whose type's offsets are in :data:`_offsets`."""
    cdef Py_ssize_t off = _offsets[i]
    cdef PyObject *p
    if off >= 0:
        p = col_slot(<PyObject *>e, off)
        if p != NULL:
            return <object>p
    return getattr(e, _names[i])


def member_offsets(type tp):
    """The byte offsets at which :func:`gather` reads ``key``, ``inflight_prefill_tokens``,
    ``inflight_decode_tokens`` and ``inflight`` on instances of ``tp``: tuple of 4 ints,
    -1 where the attribute is not a ``__slots__`` member read by the ordinary lookup (then
    :func:`gather` reads it with ``getattr``). For tests and debugging."""
    return tuple(col_member_offset(<PyTypeObject *>tp, n) for n in _names)




cdef inline double _number(object o) except? -1.0:
    """``o`` as a double; an int without the float object ``PyFloat_AsDouble`` makes."""
    if PyLong_CheckExact(o):
        return PyLong_AsDouble(o)
    return PyFloat_AsDouble(o)


cdef Py_ssize_t gather_ptr(list cands, dict slot_of, const int32_t *m, Py_ssize_t n_slots,
                           object favored_key, cnp.intp_t *sl, int32_t *ov, double *ld,
                           Py_ssize_t *favored) except -1:
    """Core of :func:`gather`: for each of the ``k`` candidates, ``sl[j]`` = its slot (-1
    without one), row ``j`` of ``ov`` (int32[k * 3]) = row ``sl[j]`` of ``m``
    (int32[n_slots * 3]; left as it is where ``m`` is NULL or the candidate has no slot)
    and, where ``ld`` (float64[3 * k]) is not NULL, ``ld[j]``, ``ld[k + j]``,
    ``ld[2k + j]`` = its prefill tokens, decode tokens and requests in flight;
    ``favored[0]`` = the first position whose key equals ``favored_key`` (left as it is
    when none does). Returns how many candidates have no slot. Raises as :func:`gather`."""
    cdef Py_ssize_t k = PyList_GET_SIZE(cands), j, slot
    cdef Py_ssize_t missing = 0
    cdef PyObject *s
    cdef object e, key
    cdef PyTypeObject *tp
    for j in range(k):
        e = <object>PyList_GET_ITEM(cands, j)
        tp = Py_TYPE(e)
        if tp != _seen_type or _seen_tag == 0 or col_type_tag(tp) != _seen_tag:
            _learn_type(tp)
        key = _attr(e, A_KEY)
        if favored[0] < 0 and favored_key is not None and (
                key is favored_key or key == favored_key):
            favored[0] = j
        s = PyDict_GetItemWithError(slot_of, key)
        if s == NULL:
            sl[j] = -1
            missing += 1
        else:
            slot = <object>s
            if m != NULL:
                if slot < 0 or slot >= n_slots:
                    raise ValueError(f"slot of {key!r} is expected to be in "
                                     f"0..{n_slots - 1}, got {slot}")
                ov[3 * j] = m[3 * slot]
                ov[3 * j + 1] = m[3 * slot + 1]
                ov[3 * j + 2] = m[3 * slot + 2]
            sl[j] = slot
        if ld != NULL:
            ld[j] = _number(_attr(e, A_PREFILL))
            ld[k + j] = _number(_attr(e, A_DECODE))
            ld[2 * k + j] = _number(_attr(e, A_INFLIGHT))
    return missing


def gather(list cands, dict slot_of, object match_out, bint local_loads,
           object favored_key=None):
    """Slots, cached blocks and local load of each candidate, in candidate order.

    Parameters
    ----------
    cands : list, length k >= 0
        Candidate endpoints: objects with ``key`` (str) and, when ``local_loads``, the
        counters ``inflight_prefill_tokens`` (tokens), ``inflight_decode_tokens`` (tokens)
        and ``inflight`` (requests).
    slot_of : dict[str, int]
        Endpoint key -> KV index slot (:attr:`motor.coordinator.kv.KvRouter.slot_map`).
    match_out : numpy.ndarray of int32, shape (n_slots, 3), C-contiguous, or None
        A prefix match's output (leading cached blocks per slot and tier); None: nothing
        cached anywhere (every overlap row is zero).
    local_loads : bool
        Whether to read the three load counters.
    favored_key : str, optional
        An endpoint key to look for (the session's last endpoint).

    Returns
    -------
    (slots, overlap, loads, missing, favored)
        ``slots``: intp[k], the slot of each candidate (-1 where its key has none);
        ``overlap``: int32[k, 3], row ``j`` = ``match_out[slots[j]]`` (zeros without a slot
        or a match); ``loads``: float64[3, k] = (prefill tokens, decode tokens, requests)
        in flight per candidate, or None without ``local_loads``; ``missing``: how many
        candidates had no slot (the caller allocates them and gathers again);
        ``favored``: the first position whose key equals ``favored_key``, -1 when none does
        (or no key was given).

    Raises
    ------
    TypeError
        ``match_out`` not an int32 numpy array; a slot that is not an int; a counter that is
        not a number; a key that cannot be hashed (an error of the key's lookup in
        ``slot_of`` is raised, not taken for a missing slot).
    ValueError
        ``match_out`` of the wrong shape / layout; a slot outside ``0 .. n_slots - 1``.
    AttributeError
        A candidate without ``key`` or (``local_loads``) one of the counters.
    """
    cdef Py_ssize_t k = PyList_GET_SIZE(cands), n_slots = 0
    cdef Py_ssize_t missing, favored = -1
    cdef const int32_t *m = NULL
    cdef cnp.ndarray arr
    # the C API, not np.empty / np.zeros through a Python call (their argument parsing)
    cdef cnp.npy_intp d1[1]
    cdef cnp.npy_intp d2[2]
    d1[0] = k
    slots = cnp.PyArray_EMPTY(1, d1, cnp.NPY_INTP, 0)
    d2[0] = k
    d2[1] = 3
    overlap = cnp.PyArray_ZEROS(2, d2, cnp.NPY_INT32, 0)
    d2[0] = 3
    d2[1] = k
    loads = cnp.PyArray_EMPTY(2, d2, cnp.NPY_FLOAT64, 0) if local_loads else None
    if match_out is not None:
        if not isinstance(match_out, cnp.ndarray):
            raise TypeError(f"match_out is expected to be a numpy int32 array of shape "
                            f"(n_slots, 3), got {type(match_out).__name__}")
        arr = <cnp.ndarray>match_out
        if cnp.PyArray_TYPE(arr) != cnp.NPY_INT32:
            raise TypeError(f"match_out is expected to have dtype int32, got {match_out.dtype}")
        if (cnp.PyArray_NDIM(arr) != 2 or cnp.PyArray_DIM(arr, 1) != 3
                or not cnp.PyArray_IS_C_CONTIGUOUS(arr)):
            raise ValueError(f"match_out is expected to be C-contiguous of shape (n_slots, 3), "
                             f"got shape {match_out.shape}")
        m = <const int32_t *>cnp.PyArray_DATA(arr)
        n_slots = cnp.PyArray_DIM(arr, 0)
    missing = gather_ptr(cands, slot_of, m, n_slots, favored_key,
                         <cnp.intp_t *>cnp.PyArray_DATA(<cnp.ndarray>slots),
                         <int32_t *>cnp.PyArray_DATA(<cnp.ndarray>overlap),
                         <double *>cnp.PyArray_DATA(<cnp.ndarray>loads) if local_loads
                         else NULL, &favored)
    return slots, overlap, loads, missing, favored


def uncached(object overlap, double prompt_tokens, double block_size, object tier_credit):
    """Prompt tokens each candidate would compute, and the share of the prompt it holds.

    Per row ``j`` of ``overlap`` (leading cached blocks per tier, :func:`gather`'s)::

        saved_j    = block_size * sum_t tier_credit[t] * overlap[j, t]        tokens
        uncached_j = max(prompt_tokens - saved_j, 0)                          tokens
        share_j    = min(block_size * sum_t overlap[j, t], prompt_tokens)
                     / max(prompt_tokens, 1)                                  0..1

    Parameters
    ----------
    overlap : numpy.ndarray of int32, shape (k, 3), C-contiguous
    prompt_tokens, block_size : float
        Tokens (>= 0), tokens per block (> 0).
    tier_credit : numpy.ndarray of float64, shape (3,), C-contiguous
        Share of a cached block's prefill saved per tier (device, host, disk).

    Returns
    -------
    (uncached, share) : numpy.ndarray of float64, shape (k,) each

    Raises
    ------
    TypeError
        Wrong array type or dtype.
    ValueError
        Wrong shapes or layout, ``block_size <= 0`` or ``prompt_tokens < 0``.
    """
    cdef cnp.ndarray ov, cr
    cdef Py_ssize_t k, j
    cdef const int32_t *o
    cdef const double *c
    cdef double saved, left, held, denom
    if not block_size > 0.0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    if not prompt_tokens >= 0.0:
        raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
    if not isinstance(overlap, cnp.ndarray) or not isinstance(tier_credit, cnp.ndarray):
        raise TypeError("overlap and tier_credit are expected to be numpy arrays, got "
                        f"{type(overlap).__name__} and {type(tier_credit).__name__}")
    ov = <cnp.ndarray>overlap
    cr = <cnp.ndarray>tier_credit
    if cnp.PyArray_TYPE(ov) != cnp.NPY_INT32 or cnp.PyArray_TYPE(cr) != cnp.NPY_FLOAT64:
        raise TypeError(f"overlap is expected to be int32 and tier_credit float64, got "
                        f"{overlap.dtype} and {tier_credit.dtype}")
    if (cnp.PyArray_NDIM(ov) != 2 or cnp.PyArray_DIM(ov, 1) != 3
            or not cnp.PyArray_IS_C_CONTIGUOUS(ov)):
        raise ValueError(f"overlap is expected to be C-contiguous of shape (k, 3), "
                         f"got shape {overlap.shape}")
    if (cnp.PyArray_NDIM(cr) != 1 or cnp.PyArray_DIM(cr, 0) != 3
            or not cnp.PyArray_IS_C_CONTIGUOUS(cr)):
        raise ValueError(f"tier_credit is expected to be C-contiguous of shape (3,), "
                         f"got shape {tier_credit.shape}")
    k = cnp.PyArray_DIM(ov, 0)
    o = <const int32_t *>cnp.PyArray_DATA(ov)
    c = <const double *>cnp.PyArray_DATA(cr)
    cdef cnp.npy_intp d1[1]
    d1[0] = k
    unc = cnp.PyArray_EMPTY(1, d1, cnp.NPY_FLOAT64, 0)
    share = cnp.PyArray_EMPTY(1, d1, cnp.NPY_FLOAT64, 0)
    cdef double *u = <double *>cnp.PyArray_DATA(<cnp.ndarray>unc)
    cdef double *s = <double *>cnp.PyArray_DATA(<cnp.ndarray>share)
    denom = prompt_tokens if prompt_tokens > 1.0 else 1.0
    for j in range(k):
        saved = block_size * (c[0] * o[3 * j] + c[1] * o[3 * j + 1] + c[2] * o[3 * j + 2])
        left = prompt_tokens - saved
        u[j] = left if left > 0.0 else 0.0
        held = block_size * (<double>o[3 * j] + o[3 * j + 1] + o[3 * j + 2])
        s[j] = (held if held < prompt_tokens else prompt_tokens) / denom
    return unc, share
