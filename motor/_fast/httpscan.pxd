# cython: language_level=3
"""The plain-message scanners' character classes and header line, shared by the compiled
HTTP/1.1 server (``http1``) and client (``upstream``); prefix ``hs_``.

A plain message is one these scanners take without httptools: they accept a strict subset
of HTTP/1.1 (RFC 9112) and decline everything else to httptools, so the classes are the
strictest reading of the grammar (``docs/fast.md``, "The plain-request scanner").

``hs_tchar[c]``: a token character (RFC 9110 section 5.6.2); ``hs_pchar[c]``: a character
taken in a request target (RFC 3986's unreserved, sub-delims, ``:@/?%``); ``hs_vchar[c]``:
visible ASCII, SP or HTAB (a header value's or reason phrase's bytes, obs-text excluded).
Everything is ``inline`` / ``static``: each module that cimports this file gets its own copy.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

cdef extern from *:
    """
    static const unsigned char hs_tchar[256] __attribute__((unused)) = {
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,1,0,1,1,1,1,1,0,0,1,1,0,1,1,0,1,1,1,1,1,1,1,1,1,1,0,0,0,0,0,0,
        0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0,1,1,
        1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,1,0,1,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0
    };
    static const unsigned char hs_pchar[256] __attribute__((unused)) = {
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,1,0,0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,1,0,1,
        1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0,0,1,
        0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0,1,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0
    };
    static const unsigned char hs_vchar[256] __attribute__((unused)) = {
        0,0,0,0,0,0,0,0,0,1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,
        1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,
        1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
        0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0
    };
    """
    const unsigned char hs_tchar[256]
    const unsigned char hs_pchar[256]
    const unsigned char hs_vchar[256]


cdef inline Py_ssize_t hs_header_line(const unsigned char *b, Py_ssize_t i, Py_ssize_t n,
                                      Py_ssize_t *colon, Py_ssize_t *vs,
                                      Py_ssize_t *ve) noexcept nogil:
    """One plain header line ``name ":" OWS value CRLF`` at ``b[i:n]``: returns the index
    after its CRLF and sets ``colon`` (the name is ``b[i:colon]``) and ``vs`` / ``ve`` (the
    value's bounds, leading whitespace skipped); -1 when the line is not plain (an empty
    name or one with a non-token byte, a space before the colon, an empty value, one with a
    CTL, a non-ASCII byte or trailing whitespace, a bare LF) or not whole. A next line that
    starts with whitespace (obs-fold) is not a token: the next call declines it."""
    cdef Py_ssize_t j = i
    while j < n and hs_tchar[b[j]]:
        j += 1
    if j == i or j >= n or b[j] != 58:          # b":"
        return -1
    colon[0] = j
    j += 1
    while j < n and (b[j] == 32 or b[j] == 9):
        j += 1
    vs[0] = j
    while j < n and hs_vchar[b[j]]:
        j += 1
    ve[0] = j
    if j + 2 > n or b[j] != 13 or b[j + 1] != 10 or j == vs[0] \
            or b[j - 1] == 32 or b[j - 1] == 9:
        return -1
    return j + 2


cdef inline bint hs_is_word(const unsigned char *v, Py_ssize_t n, const char *word,
                            Py_ssize_t k) noexcept nogil:
    """``v[:n]`` is the lower-case ``word[:k]`` in any letter case."""
    cdef Py_ssize_t i
    if n != k:
        return False
    for i in range(k):
        if (v[i] | 32) != <unsigned char>word[i]:
            return False
    return True


cdef inline bint hs_is_keep_alive(const unsigned char *v, Py_ssize_t n) noexcept nogil:
    """``v[:n]`` is ``keep-alive`` in any letter case."""
    return hs_is_word(v, n, b"keep-alive", 10)


cdef inline long long hs_length(const unsigned char *b, Py_ssize_t vs,
                                Py_ssize_t ve) noexcept nogil:
    """A plain ``Content-Length`` value ``b[vs:ve]`` (1 to 18 ASCII digits), else -1."""
    cdef long long v = 0
    cdef Py_ssize_t k
    if ve - vs > 18 or ve == vs:
        return -1
    for k in range(vs, ve):
        if not 48 <= b[k] <= 57:
            return -1
        v = v * 10 + (b[k] - 48)
    return v


cdef inline bytes hs_lower_name(const unsigned char *b, Py_ssize_t i, Py_ssize_t n):
    """``b[i:i + n]`` (a header name) as bytes, ASCII letters lower-cased."""
    cdef bytes name = PyBytes_FromStringAndSize(NULL, n)
    cdef char *w = PyBytes_AS_STRING(name)
    cdef Py_ssize_t k
    cdef unsigned char c
    for k in range(n):
        c = b[i + k]
        w[k] = c | 32 if 65 <= c <= 90 else c
    return name
