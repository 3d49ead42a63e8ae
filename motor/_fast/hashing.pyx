# cython: language_level=3
"""Chained 64-bit block hashes of token ids.

A prompt's token ids are cut into blocks of ``block_size`` tokens (only full
blocks). Block ``k``'s hash folds in the hash of block ``k - 1`` (its parent), so
two prompts share the hash of block ``k`` exactly when (up to a 2**-64
collision) they share tokens ``0 .. (k + 1) * block_size - 1``, the parent hash
they started from, the ``extra`` salt and the block size.

Recurrence (``docs/fast.md`` has the full statement and the quality checks)::

    w_j      = tok[2j] | tok[2j+1] << 32         (j-th 64-bit word of the block;
                                                   an odd block's last word is the
                                                   lone token, zero-extended)
    lane_l   = S_l ^ (extra * ME)                 (four lanes, l = 0..3)
    for j:   lane_{j%4} = xs32((lane_{j%4} ^ w_j) * M_{j%4})
    c        = block_size * MLEN
    for l:   c = xs32((c ^ lane_l) * MC)
    h        = mix13(c ^ (parent * MP));  h = HASH_ZERO_REMAP if h == 0

where ``xs32(x) = x ^ (x >> 32)`` and ``mix13`` is Stafford's 64-bit finaliser.
The hash is our own; the only borrowed numbers are the three mix13 constants.
"""
from libc.stdint cimport uint32_t, uint64_t
from cpython.buffer cimport PyBuffer_Release
from cpython.object cimport PyObject
from cpython.sequence cimport PySequence_Fast_ITEMS
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cimport numpy as cnp
import numpy as np

from motor._fast._common cimport (mf_get_uint_buffer, MF_BUF_OK, MF_BUF_NOT_CONTIGUOUS,
                                  MOTOR_DEBUG)

cnp.import_array()

cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    /* Lane multipliers and seeds: odd 64-bit numbers drawn once from
       random.Random(20261129) with 28..36 set bits. */
    #define MH_M0   0x6cc6be1805fdf179ULL
    #define MH_M1   0x4ba71ab7ac0504a5ULL
    #define MH_M2   0xdae85d0928398f9fULL
    #define MH_M3   0x0b8e90e9f6466d5fULL
    #define MH_S0   0xc4e08e67b822b63bULL
    #define MH_S1   0x28b58ab4d47a9a79ULL
    #define MH_S2   0x25318bf27b885975ULL
    #define MH_S3   0x3d3db70b0d99ed21ULL
    #define MH_MC   0x87a152f460ca36ffULL
    #define MH_MP   0x167dd69a83f614ddULL
    #define MH_ME   0xfda536a3a434d6f9ULL
    #define MH_MLEN 0x9d4615766cd44f91ULL
    #define MH_ZERO_REMAP 0x2545F4914F6CDD1DULL

    static inline uint64_t mh_xs32(uint64_t x) { return x ^ (x >> 32); }

    /* Stafford "Mix13" finaliser (D. Stafford, "Better Bit Mixing", 2011). */
    static inline uint64_t mh_mix13(uint64_t x) {
        x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
        x ^= x >> 27; x *= 0x94d049bb133111ebULL;
        x ^= x >> 31;
        return x;
    }

    static inline uint64_t mh_word(const uint32_t *t) {
        return (uint64_t)t[0] | ((uint64_t)t[1] << 32);
    }

    /* Content hash of one block (parent not folded in yet). Four independent
       lanes let the CPU overlap the multiplies. */
    static inline uint64_t mh_content(const uint32_t *t, ptrdiff_t n, uint64_t extra) {
        uint64_t e = extra * MH_ME;
        uint64_t a0 = MH_S0 ^ e, a1 = MH_S1 ^ e, a2 = MH_S2 ^ e, a3 = MH_S3 ^ e;
        ptrdiff_t nw = n >> 1, j = 0;
        for (; j + 4 <= nw; j += 4) {
            const uint32_t *p = t + 2 * j;
            a0 = mh_xs32((a0 ^ mh_word(p + 0)) * MH_M0);
            a1 = mh_xs32((a1 ^ mh_word(p + 2)) * MH_M1);
            a2 = mh_xs32((a2 ^ mh_word(p + 4)) * MH_M2);
            a3 = mh_xs32((a3 ^ mh_word(p + 6)) * MH_M3);
        }
        /* 0..3 remaining words, then an odd block's lone last token, continue
           the lane rotation (lane = word index % 4). */
        uint64_t rest[4];
        ptrdiff_t r = 0;
        for (; j < nw; j++) rest[r++] = mh_word(t + 2 * j);
        if (n & 1) rest[r++] = (uint64_t)t[n - 1];
        if (r > 0) a0 = mh_xs32((a0 ^ rest[0]) * MH_M0);
        if (r > 1) a1 = mh_xs32((a1 ^ rest[1]) * MH_M1);
        if (r > 2) a2 = mh_xs32((a2 ^ rest[2]) * MH_M2);
        if (r > 3) a3 = mh_xs32((a3 ^ rest[3]) * MH_M3);
        uint64_t c = (uint64_t)n * MH_MLEN;
        c = mh_xs32((c ^ a0) * MH_MC);
        c = mh_xs32((c ^ a1) * MH_MC);
        c = mh_xs32((c ^ a2) * MH_MC);
        c = mh_xs32((c ^ a3) * MH_MC);
        return c;
    }

    static inline uint64_t mh_chain(uint64_t content, uint64_t parent) {
        uint64_t h = mh_mix13(content ^ (parent * MH_MP));
        return h ? h : MH_ZERO_REMAP;
    }

    static uint64_t mh_hash_block(uint64_t parent, const uint32_t *t, ptrdiff_t n,
                                  uint64_t extra) {
        return mh_chain(mh_content(t, n, extra), parent);
    }

    static void mh_block_hashes(const uint32_t *t, ptrdiff_t n_blocks, ptrdiff_t bs,
                                uint64_t parent, uint64_t extra, uint64_t *out) {
        uint64_t h = parent;
        for (ptrdiff_t k = 0; k < n_blocks; k++) {
            /* The content hash does not depend on h, so the CPU computes the
               next blocks' content while the short parent chain completes. */
            h = mh_chain(mh_content(t + k * bs, bs, extra), h);
            out[k] = h;
        }
    }
    """
    const uint64_t MH_ZERO_REMAP
    uint64_t mh_hash_block(uint64_t parent, const uint32_t *t, Py_ssize_t n,
                           uint64_t extra) noexcept nogil
    void mh_block_hashes(const uint32_t *t, Py_ssize_t n_blocks, Py_ssize_t bs,
                         uint64_t parent, uint64_t extra, uint64_t *out) noexcept nogil


#: A block whose recurrence yields 0 gets this hash instead (0 is the root sentinel).
HASH_ZERO_REMAP = MH_ZERO_REMAP
#: True when compiled with ``-DMOTOR_DEBUG=1``.
DEBUG = bool(MOTOR_DEBUG)

cdef object _np_uint32 = np.uint32
cdef object _np_ascontiguousarray = np.ascontiguousarray


cdef uint64_t hash_block_ptr(uint64_t parent, const uint32_t *tokens, Py_ssize_t n,
                             uint64_t extra) noexcept nogil:
    return mh_hash_block(parent, tokens, n, extra)


cdef void block_hashes_ptr(const uint32_t *tokens, Py_ssize_t n_blocks,
                           Py_ssize_t block_size, uint64_t parent, uint64_t extra,
                           uint64_t *out) noexcept nogil:
    mh_block_hashes(tokens, n_blocks, block_size, parent, extra, out)


cdef struct _TokenView:
    const uint32_t *ptr
    Py_ssize_t n
    bint has_view
    uint32_t *owned
    Py_buffer view


cdef extern from *:
    """
    /* A token id as uint32 when it is an exact int that CPython 3.11 keeps in one or two
       30-bit digits below 2^32 (every token id): read from the object, no call, no
       error state. 0: not such an int (another version, a subclass, negative, large):
       the caller converts it the general way and says what is wrong. */
    static inline int mh_small_u32(PyObject *o, uint32_t *out) {
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(PYPY_VERSION)
        if (PyLong_CheckExact(o)) {
            Py_ssize_t s = Py_SIZE(o);
            const digit *d = ((PyLongObject *)o)->ob_digit;
            if (s == 1) { *out = (uint32_t)d[0]; return 1; }
            if (s == 0) { *out = 0; return 1; }
            if (s == 2) {
                uint64_t v = ((uint64_t)d[1] << PyLong_SHIFT) | (uint64_t)d[0];
                if (v <= 0xFFFFFFFFULL) { *out = (uint32_t)v; return 1; }
            }
        }
    #endif
        return 0;
    }
    """
    int mh_small_u32(PyObject *o, uint32_t *out) noexcept


cdef int _list_to_u32(object seq, _TokenView *tv) except -1:
    """Copy a list/tuple of ints into a malloc'd uint32 array (tv.owned)."""
    cdef Py_ssize_t i, n = len(seq)
    cdef unsigned long v
    cdef PyObject **items = PySequence_Fast_ITEMS(seq)
    tv.owned = <uint32_t *>malloc((n if n > 0 else 1) * sizeof(uint32_t))
    if tv.owned == NULL:
        raise MemoryError()
    tv.ptr = tv.owned
    tv.n = n
    for i in range(n):
        if mh_small_u32(items[i], tv.owned + i):
            continue
        item = seq[i]
        if not isinstance(item, int):
            raise TypeError(f"tokens is expected to hold ints, got {type(item).__name__} "
                            f"(tokens[{i}])")
        v = item  # OverflowError when negative or > unsigned long
        if v > 0xFFFFFFFFUL:
            raise OverflowError(f"tokens[{i}] is expected to fit in uint32, got {item}")
        tv.owned[i] = <uint32_t>v
    return 0


cdef int _get_tokens(object tokens, _TokenView *tv) except -1:
    """Point ``tv`` at ``tokens`` as a contiguous uint32 array. Lists and tuples are
    converted, strided buffers copied. Release with :func:`_release_tokens`."""
    tv.has_view = False
    tv.owned = NULL
    if isinstance(tokens, (list, tuple)):
        return _list_to_u32(tokens, tv)
    if mf_get_uint_buffer(tokens, &tv.view, 4, "tokens") == MF_BUF_NOT_CONTIGUOUS:
        tokens = _np_ascontiguousarray(tokens)
        mf_get_uint_buffer(tokens, &tv.view, 4, "tokens")
    tv.has_view = True
    tv.ptr = <const uint32_t *>tv.view.buf
    tv.n = tv.view.shape[0]
    return 0


cdef void _release_tokens(_TokenView *tv) noexcept:
    if tv.has_view:
        PyBuffer_Release(&tv.view)
        tv.has_view = False
    if tv.owned != NULL:
        free(tv.owned)
        tv.owned = NULL


def block_hashes(tokens, Py_ssize_t block_size, uint64_t parent=0, uint64_t extra=0):
    """Chained hashes of the full blocks of ``tokens``.

    Parameters
    ----------
    tokens : 1-D buffer of uint32, length n
        Token ids (numpy array, memoryview, ``array('I')``; a list or tuple of ints
        is converted). A strided buffer is copied first.
    block_size : int
        Tokens per block, > 0.
    parent : int, optional
        Hash of the block before ``tokens[0]``; 0 (default) means the root.
    extra : int, optional
        64-bit salt folded into every block (seed, LoRA id, cache salt), 0 = none.

    Returns
    -------
    numpy.ndarray of uint64, shape (n // block_size,)
        ``out[k]`` is the hash of tokens ``[k*block_size, (k+1)*block_size)`` chained
        to ``out[k-1]`` (``parent`` for k = 0). Never 0. A trailing partial block is
        not hashed.

    Raises
    ------
    ValueError
        ``block_size <= 0`` or ``tokens`` not 1-D.
    TypeError
        ``tokens`` is not a buffer of 4-byte unsigned ints.
    OverflowError
        ``parent`` or ``extra`` outside [0, 2**64), or a list item outside uint32.
    """
    cdef _TokenView tv
    cdef Py_ssize_t n_blocks
    cdef cnp.npy_intp dims[1]
    cdef cnp.ndarray out
    cdef uint64_t *dst
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    tv.has_view = False
    tv.owned = NULL
    try:
        _get_tokens(tokens, &tv)
        n_blocks = tv.n // block_size
        dims[0] = n_blocks
        out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        dst = <uint64_t *>cnp.PyArray_DATA(out)
        with nogil:
            mh_block_hashes(tv.ptr, n_blocks, block_size, parent, extra, dst)
    finally:
        _release_tokens(&tv)
    return out


def block_hashes_into(tokens, Py_ssize_t block_size, out, uint64_t parent=0,
                      uint64_t extra=0):
    """Like :func:`block_hashes` but write into a preallocated buffer.

    Parameters
    ----------
    tokens : 1-D buffer of uint32, length n
    block_size : int, > 0
    out : writable 1-D buffer of uint64, length >= n // block_size
    parent, extra : int, optional
        As in :func:`block_hashes`.

    Returns
    -------
    int
        Number of hashes written, ``n // block_size``.

    Raises
    ------
    ValueError
        ``block_size <= 0`` or ``out`` too short.
    TypeError
        Wrong dtype of ``tokens`` or ``out``, or ``out`` read-only / strided.
    """
    cdef _TokenView tv
    cdef uint64_t[::1] dst
    cdef Py_ssize_t n_blocks
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    try:
        dst = out
    except (ValueError, BufferError) as exc:
        raise TypeError(f"out is expected to be a writable C-contiguous uint64 buffer: "
                        f"{exc}") from None
    tv.has_view = False
    tv.owned = NULL
    try:
        _get_tokens(tokens, &tv)
        n_blocks = tv.n // block_size
        if dst.shape[0] < n_blocks:
            raise ValueError(f"out is expected to hold >= {n_blocks} hashes, "
                             f"got length {dst.shape[0]}")
        if n_blocks:
            with nogil:
                mh_block_hashes(tv.ptr, n_blocks, block_size, parent, extra, &dst[0])
    finally:
        _release_tokens(&tv)
    return n_blocks


def hash_block(uint64_t parent, tokens, uint64_t extra=0):
    """Hash of one block given its parent's hash (for engine KV events).

    ``hash_block(p, t[:bs], e) == block_hashes(t, bs, p, e)[0]``.

    Parameters
    ----------
    parent : int
        Parent block hash, 0 for the root.
    tokens : 1-D buffer of uint32 (or list of ints), length block_size >= 1
        The block's token ids; its length is the block size.
    extra : int, optional
        Salt as in :func:`block_hashes`.

    Returns
    -------
    int
        The block hash in [1, 2**64).

    Raises
    ------
    ValueError
        ``tokens`` is empty or not 1-D.
    TypeError
        ``tokens`` is not a buffer of 4-byte unsigned ints.
    """
    cdef _TokenView tv
    cdef uint64_t h
    tv.has_view = False
    tv.owned = NULL
    try:
        _get_tokens(tokens, &tv)
        if tv.n == 0:
            raise ValueError("tokens is expected to hold one block (>= 1 token), got 0")
        h = mh_hash_block(parent, tv.ptr, tv.n, extra)
    finally:
        _release_tokens(&tv)
    return h


def extend_hashes(prefix, tokens, Py_ssize_t block_size, uint64_t extra=0):
    """The hashes of a prompt from those of its leading full blocks: ``prefix`` followed by
    the hashes of the full blocks of ``tokens`` (the tokens after those blocks), chained to
    the last of ``prefix`` (to the root when it is empty).

    ``extend_hashes(block_hashes(t[:k * bs], bs, 0, e), t[k * bs:], bs, e)`` equals
    ``block_hashes(t, bs, 0, e)`` (one allocation, no ``numpy.concatenate``).

    Parameters
    ----------
    prefix : 1-D buffer of uint64, length m
        Hashes of the leading full blocks (from :func:`block_hashes`).
    tokens : 1-D buffer of uint32 (or list of ints), length n
        The tokens after those blocks.
    block_size : int
        Tokens per block, > 0.
    extra : int, optional
        Salt as in :func:`block_hashes`.

    Returns
    -------
    numpy.ndarray of uint64, shape (m + n // block_size,)
        A new array.

    Raises
    ------
    ValueError
        ``block_size <= 0``, or a buffer not 1-D.
    TypeError
        ``prefix`` not a buffer of 8-byte unsigned ints, or ``tokens`` not of 4-byte ones.
    """
    cdef _TokenView tv
    cdef Py_buffer pv
    cdef bint have_p = False
    cdef Py_ssize_t m, n_blocks
    cdef cnp.npy_intp dims[1]
    cdef cnp.ndarray out
    cdef uint64_t *dst
    cdef const uint64_t *src
    cdef uint64_t parent
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    tv.has_view = False
    tv.owned = NULL
    try:
        if mf_get_uint_buffer(prefix, &pv, 8, "prefix") == MF_BUF_NOT_CONTIGUOUS:
            prefix = _np_ascontiguousarray(prefix)
            mf_get_uint_buffer(prefix, &pv, 8, "prefix")
        have_p = True
        _get_tokens(tokens, &tv)
        m = pv.shape[0]
        src = <const uint64_t *>pv.buf
        n_blocks = tv.n // block_size
        dims[0] = m + n_blocks
        out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        dst = <uint64_t *>cnp.PyArray_DATA(out)
        parent = src[m - 1] if m else 0
        with nogil:
            memcpy(dst, src, m * sizeof(uint64_t))
            mh_block_hashes(tv.ptr, n_blocks, block_size, parent, extra, dst + m)
    finally:
        if have_p:
            PyBuffer_Release(&pv)
        _release_tokens(&tv)
    return out
