# cython: language_level=3
"""C helpers shared by the ``motor._fast`` modules (prefix ``mf_``).

Everything here is ``inline``: each module that cimports this file gets its own
copy, there is no shared runtime object.
"""
cimport cython
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize,
                           PyBytes_GET_SIZE)
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_FORMAT,
                             PyBUF_ND, PyBUF_STRIDES)

cdef extern from *:
    """
    #include <stdint.h>
    #ifndef MOTOR_DEBUG
    #define MOTOR_DEBUG 0
    #endif
    #if defined(__GNUC__) || defined(__clang__)
    #define mf_likely(x)   __builtin_expect(!!(x), 1)
    #define mf_unlikely(x) __builtin_expect(!!(x), 0)
    #define mf_prefetch(p) __builtin_prefetch((const void *)(p), 0, 3)
    #define mf_popcount64(x) ((int)__builtin_popcountll((unsigned long long)(x)))
    #define mf_ctz64(x) ((int)__builtin_ctzll((unsigned long long)(x)))
    #else
    #error "motor._fast needs GCC or clang builtins"
    #endif
    /* 64x64 -> high 64 bits of the product. */
    static inline uint64_t mf_mulhi64(uint64_t a, uint64_t b) {
        return (uint64_t)(((unsigned __int128)a * (unsigned __int128)b) >> 64);
    }
    """
    const int MOTOR_DEBUG
    bint mf_likely(bint) nogil
    bint mf_unlikely(bint) nogil
    void mf_prefetch(const void *) nogil
    int mf_popcount64(uint64_t) nogil
    int mf_ctz64(uint64_t) nogil
    uint64_t mf_mulhi64(uint64_t, uint64_t) nogil


cdef enum MfBufferStatus:
    MF_BUF_OK = 0
    MF_BUF_NOT_CONTIGUOUS = 1


cdef inline bint _mf_format_ok(const char *fmt, Py_ssize_t itemsize,
                               Py_ssize_t want_itemsize) noexcept:
    """True when a PEP 3118 format string is an unsigned native/little integer of
    ``want_itemsize`` bytes ('I', 'L', 'Q', optionally prefixed by '@', '=', '<')."""
    if itemsize != want_itemsize:
        return False
    if fmt == NULL:
        return False
    if fmt[0] == b'@' or fmt[0] == b'=' or fmt[0] == b'<':
        fmt += 1
    if fmt[0] == 0 or fmt[1] != 0:
        return False
    if want_itemsize == 4:
        return fmt[0] == b'I' or fmt[0] == b'L'
    if want_itemsize == 8:
        return fmt[0] == b'Q' or fmt[0] == b'L'
    return False


cdef inline int mf_get_uint_buffer(object obj, Py_buffer *view, Py_ssize_t itemsize,
                                   str name) except -1:
    """Acquire ``obj`` as a 1-D buffer of unsigned ``itemsize``-byte integers.

    Returns ``MF_BUF_OK`` with ``view`` filled (the caller releases it), or
    ``MF_BUF_NOT_CONTIGUOUS`` (nothing held) when the buffer is strided, so the
    caller may copy it. Raises TypeError for a non-buffer or a wrong item type and
    ValueError for a wrong number of dimensions.
    """
    cdef const char *fmt
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_STRIDES)
    except (TypeError, BufferError):
        raise TypeError(
            f"{name} is expected to be a 1-D buffer of uint{itemsize * 8}, "
            f"got {type(obj).__name__}") from None
    fmt = view.format
    if not _mf_format_ok(fmt, view.itemsize, itemsize):
        got = (fmt.decode("ascii", "replace") if fmt != NULL else "?")
        PyBuffer_Release(view)
        raise TypeError(
            f"{name} is expected to have dtype uint{itemsize * 8}, got buffer format "
            f"{got!r} with itemsize {view.itemsize}")
    if view.ndim != 1:
        nd = view.ndim
        PyBuffer_Release(view)
        raise ValueError(f"{name} is expected to be 1-D, got {nd} dimensions")
    if view.strides != NULL and view.shape[0] > 1 and view.strides[0] != itemsize:
        PyBuffer_Release(view)
        return MF_BUF_NOT_CONTIGUOUS
    return MF_BUF_OK


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline object mf_join(list parts):
    """``b"".join(parts)``: one copy into a bytes object of the summed size.

    ``bytes.join`` takes and releases a ``Py_buffer`` of every item (~100 instructions an
    item; an HTTP head is 10-30 items); here the items are read in place when every one is
    an exact ``bytes``, else ``bytes.join`` does it (a ``memoryview``, a ``bytearray``).
    One item: that item itself, as ``bytes.join`` returns it."""
    cdef Py_ssize_t n = len(parts)
    cdef Py_ssize_t total = 0
    cdef Py_ssize_t i, k
    cdef object p
    cdef char *out
    if n == 1 and PyBytes_CheckExact(parts[0]):
        return parts[0]
    for i in range(n):
        p = parts[i]
        if not PyBytes_CheckExact(p):
            return b"".join(parts)
        total += PyBytes_GET_SIZE(p)
    r = PyBytes_FromStringAndSize(NULL, total)
    out = PyBytes_AS_STRING(r)
    for i in range(n):
        p = parts[i]
        k = PyBytes_GET_SIZE(p)
        memcpy(out, PyBytes_AS_STRING(p), k)
        out += k
    return r
