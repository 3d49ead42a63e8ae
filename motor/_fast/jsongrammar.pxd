# cython: language_level=3
"""C-level API of ``motor._fast.jsongrammar`` (see jsongrammar.pyx): a strict scanner of the
JSON grammar (RFC 8259) on bytes, shared by the SSE scanner and the request scanner."""

cdef enum:                   # bytes of the grammar
    CH_TAB = 9
    CH_LF = 10
    CH_CR = 13
    CH_SPACE = 32
    CH_QUOTE = 34
    CH_PLUS = 43
    CH_COMMA = 44
    CH_MINUS = 45
    CH_DOT = 46
    CH_SLASH = 47
    CH_0 = 48
    CH_1 = 49
    CH_9 = 57
    CH_COLON = 58
    CH_UPPER_E = 69
    CH_LBRACKET = 91
    CH_BACKSLASH = 92
    CH_RBRACKET = 93
    CH_LOWER_E = 101
    CH_LBRACE = 123
    CH_RBRACE = 125


cdef enum:
    JSON_MAX_DEPTH = 64       # nesting of a skipped value; deeper: not taken (-1)
    JSON_MAX_INT_DIGITS = 18  # digits of an integer part (fits int64); more: not taken (-1)


cdef inline Py_ssize_t json_ws(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The offset of the first byte at or after ``i`` that is not JSON whitespace (space,
    tab, CR, LF: bits 32, 9, 13, 10 of one mask), at most ``n``."""
    while i < n and p[i] <= CH_SPACE and (<unsigned long long>0x100002600 >> p[i]) & 1:
        i += 1
    return i


cdef Py_ssize_t json_string(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                            bint *esc) noexcept nogil
cdef Py_ssize_t json_number(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
cdef Py_ssize_t json_skip(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                          int depth) noexcept nogil
