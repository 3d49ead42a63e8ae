# cython: language_level=3
"""A strict scanner of the JSON grammar (RFC 8259) on bytes, with no Python object made:
the offset after a string, a number or any value, or -1 when the bytes are not one.

Shared by :mod:`motor._fast.sse` (an engine's stream events) and :mod:`motor._fast.reqscan`
(a client's request body). What it accepts is a subset of what ``orjson.loads`` accepts, so
a caller can take a document it accepts as one ``orjson`` parses, and hand anything else to
``orjson`` (which then decides, and words the error).

Grammar accepted: whitespace is space, tab, CR, LF; strings are valid UTF-8 (no overlong
form, no surrogate, at most U+10FFFF) without control characters; escapes
``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`` but a UTF-16 surrogate's; numbers
``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`` with an integer part of at most
:data:`JSON_MAX_INT_DIGITS` digits and an exponent of at most 2; ``true``, ``false``,
``null``; nesting at most :data:`JSON_MAX_DEPTH` deep. Outside that, -1 (the caller's slow
path).

The string scan reads runs of plain bytes with no bound check a byte: ``p[n]`` must not be
a plain byte (a ``bytes`` object's terminating NUL, or an event's ``\\n``).
"""
from libc.string cimport memcmp


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* The offset of the first byte at or after i that is not a plain string byte (ASCII
       0x20..0x7f but '"' and '\\'), looking 16 (SSE2) or 8 (any other target) bytes at a
       time while a whole chunk lies below n; where the chunks stop it returns the chunk's
       start, and the caller goes on byte by byte (bytes at n and above are not read). */
    static inline Py_ssize_t mf_plain_run(const unsigned char *p, Py_ssize_t i,
                                          Py_ssize_t n) {
    #if defined(__SSE2__)
        const __m128i quote = _mm_set1_epi8(0x22), bslash = _mm_set1_epi8(0x5c);
        const __m128i space = _mm_set1_epi8(0x20);
        while (i + 16 <= n) {
            __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
            /* signed: bytes >= 0x80 are negative, so "< 0x20" takes them too */
            __m128i bad = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote),
                                                    _mm_cmpeq_epi8(v, bslash)),
                                       _mm_cmplt_epi8(v, space));
            int m = _mm_movemask_epi8(bad);
            if (m)
                return i + __builtin_ctz((unsigned)m);
            i += 16;
        }
    #else
        const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
        while (i + 8 <= n) {
            uint64_t x, q, b;
            memcpy(&x, p + i, 8);
            q = x ^ (ones * 0x22);
            b = x ^ (ones * 0x5c);
            /* any byte >= 0x80, < 0x20, == '"' or == '\\' (exact as a whole: the byte
               found is looked at again one by one) */
            if ((x | ((x - ones * 0x20) & ~x) | ((q - ones) & ~q) | ((b - ones) & ~b))
                    & highs)
                return i;
            i += 8;
        }
    #endif
        return i;
    }
    """
    Py_ssize_t mf_plain_run(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) nogil


# -- the grammar ------------------------------------------------------------------------
cdef inline int _hex(unsigned char c) noexcept nogil:
    if CH_0 <= c <= CH_9:
        return c - CH_0
    if 97 <= c <= 102:       # a-f
        return c - 87
    if 65 <= c <= 70:        # A-F
        return c - 55
    return -1


cdef inline int _utf8(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Length of the valid UTF-8 sequence that starts with the byte >= 0x80 at ``i``; 0
    when it is not one (overlong, surrogate, above U+10FFFF, truncated)."""
    cdef unsigned char c = p[i]
    cdef unsigned char lo = 0x80, hi = 0xBF
    cdef int k, j
    if 0xC2 <= c <= 0xDF:
        k = 2
    elif 0xE0 <= c <= 0xEF:
        k = 3
        if c == 0xE0:
            lo = 0xA0
        elif c == 0xED:
            hi = 0x9F
    elif 0xF0 <= c <= 0xF4:
        k = 4
        if c == 0xF0:
            lo = 0x90
        elif c == 0xF4:
            hi = 0x8F
    else:
        return 0
    if i + k > n:
        return 0
    if not (lo <= p[i + 1] <= hi):
        return 0
    for j in range(2, k):
        if not (0x80 <= p[i + j] <= 0xBF):
            return 0
    return k


#: 1 for the bytes a string takes as they are (printable ASCII but ``"`` and ``\\``): the
#: string scan skips runs of them with one table read a byte
cdef unsigned char _PLAIN[256]
cdef int _b
for _b in range(256):
    _PLAIN[_b] = 1 if 0x20 <= _b < 0x80 and _b != CH_QUOTE and _b != CH_BACKSLASH else 0


cdef Py_ssize_t json_string(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                        bint *esc) noexcept nogil:
    """``p[i]`` is a string's opening quote: the offset after its closing quote, -1 when
    it is not a valid string (or escapes a surrogate). ``esc`` is set when it has an
    escape. ``p[n]`` must not be a plain byte (``_PLAIN``): every caller's ``n`` is an
    event's end, where the block holds its ``\n`` or the NUL a ``bytes`` object ends with,
    so the run of plain bytes needs no bound check a byte."""
    cdef unsigned char c
    cdef int u, h, k, j
    i += 1
    while True:
        i = mf_plain_run(p, i, n)   # the run of plain bytes (the common case: all of it),
        while _PLAIN[p[i]]:         # by chunks, then its last bytes one by one
            i += 1
        if i >= n:
            return -1
        c = p[i]
        if c == CH_QUOTE:
            return i + 1
        if c == CH_BACKSLASH:
            esc[0] = True
            if i + 1 >= n:
                return -1
            c = p[i + 1]
            if c == 117:     # \uXXXX
                if i + 5 >= n:
                    return -1
                u = 0
                for j in range(2, 6):
                    h = _hex(p[i + j])
                    if h < 0:
                        return -1
                    u = (u << 4) | h
                if 0xD800 <= u <= 0xDFFF:
                    return -1
                i += 6
            elif (c == CH_QUOTE or c == CH_BACKSLASH or c == CH_SLASH or c == 98 or c == 102
                  or c == 110 or c == 114 or c == 116):     # " \ / b f n r t
                i += 2
            else:
                return -1
        elif c < 0x20:
            return -1
        elif c < 0x80:
            i += 1
        else:
            k = _utf8(p, i, n)
            if k == 0:
                return -1
            i += k


cdef Py_ssize_t json_number(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """A JSON number at ``i``: the offset after it, -1 when invalid or outside what the
    scanner takes (integer part over 18 digits, exponent over 2 digits)."""
    cdef Py_ssize_t s
    if i < n and p[i] == CH_MINUS:
        i += 1
    if i >= n:
        return -1
    if p[i] == CH_0:
        i += 1
    elif CH_1 <= p[i] <= CH_9:
        s = i
        while i < n and CH_0 <= p[i] <= CH_9:
            i += 1
        if i - s > JSON_MAX_INT_DIGITS:
            return -1
    else:
        return -1
    if i < n and p[i] == CH_DOT:
        i += 1
        s = i
        while i < n and CH_0 <= p[i] <= CH_9:
            i += 1
        if i == s:
            return -1
    if i < n and (p[i] == CH_LOWER_E or p[i] == CH_UPPER_E):
        i += 1
        if i < n and (p[i] == CH_PLUS or p[i] == CH_MINUS):
            i += 1
        s = i
        while i < n and CH_0 <= p[i] <= CH_9:
            i += 1
        if i == s or i - s > 2:
            return -1
    return i


cdef inline Py_ssize_t _literal(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                                const char *word, Py_ssize_t k) noexcept nogil:
    if i + k <= n and memcmp(p + i, word, k) == 0:
        return i + k
    return -1


cdef Py_ssize_t json_skip(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                      int depth) noexcept nogil:
    """Any JSON value at ``i``: the offset after it, -1 when invalid (or nested deeper than
    ``JSON_MAX_DEPTH``)."""
    cdef unsigned char c, close
    cdef bint esc = False
    if i >= n:
        return -1
    c = p[i]
    if c == CH_QUOTE:
        return json_string(p, i, n, &esc)
    if c == CH_LBRACE or c == CH_LBRACKET:
        if depth >= JSON_MAX_DEPTH:
            return -1
        close = CH_RBRACE if c == CH_LBRACE else CH_RBRACKET
        i = json_ws(p, i + 1, n)
        if i < n and p[i] == close:
            return i + 1
        while True:
            if c == CH_LBRACE:
                if i >= n or p[i] != CH_QUOTE:
                    return -1
                i = json_string(p, i, n, &esc)
                if i < 0:
                    return -1
                i = json_ws(p, i, n)
                if i >= n or p[i] != CH_COLON:
                    return -1
                i = json_ws(p, i + 1, n)
            i = json_skip(p, i, n, depth + 1)
            if i < 0:
                return -1
            i = json_ws(p, i, n)
            if i >= n:
                return -1
            if p[i] == CH_COMMA:
                i = json_ws(p, i + 1, n)
                continue
            if p[i] == close:
                return i + 1
            return -1
    if c == CH_MINUS or CH_0 <= c <= CH_9:
        return json_number(p, i, n)
    if c == 116:
        return _literal(p, i, n, b"true", 4)
    if c == 102:
        return _literal(p, i, n, b"false", 5)
    if c == 110:
        return _literal(p, i, n, b"null", 4)
    return -1


def value_end(bytes data not None, Py_ssize_t start=0):
    """The offset after the JSON value that starts at ``data[start]`` (no whitespace before
    it), or -1 when the bytes there are not one this grammar takes. For tests: the C
    functions above are the API.

    Raises
    ------
    IndexError
        when ``start`` is not in ``0 .. len(data)``.
    """
    cdef Py_ssize_t n = len(data)
    if start < 0 or start > n:
        raise IndexError(f"start is expected in 0..{n}, got {start}")
    return json_skip(<const unsigned char *>(<char *>data), start, n, 0)
