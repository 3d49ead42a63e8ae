# cython: language_level=3
"""Pre-tokenization of a chat's text for the routing key: the split at added tokens
(:func:`split_added`), the GPT-2 word split of ASCII text and the word-by-word assembly of
its token ids.

``tokenizers``' ``ByteLevel`` pre-tokenizer (``use_regex``) cuts text with GPT-2's pattern;
on ASCII text it is (:data:`motor.coordinator.tokenize._BYTE_LEVEL_ASCII`, ``re.ASCII``)::

    '(?:[stmd]|re|ve|ll) | ?[A-Za-z]++ | ?[0-9]++ | ?[^\\sA-Za-z0-9]++ | \\s+(?!\\S) | \\s+

with ``\\s`` the six characters `` \\t\\n\\v\\f\\r``. Every character starts a match of one of
the alternatives, so the words cover the text. At position ``p``, leftmost alternative first:

* ``'`` followed by ``s``, ``t``, ``m``, ``d`` (2 characters) or ``re``, ``ve``, ``ll`` (3);
* an optional space, then a run of letters, or of digits, or of other non-white-space
  characters (the space is taken when the character after it starts such a run);
* white space: its whole run when it ends the text; else, when the run is followed by a
  non-white-space character, the run less its last character (``\\s+(?!\\S)``
  backtracks one), or the single character when the run is one long (``\\s+``).

:func:`split_ascii_words` is that split; :func:`encode_ascii_words` the concatenated token
ids of the words, each read from a dict (the word cache) and computed by a callback only
when missing. Tested equal to the regex on any ASCII text (``tests/unit/_fast/test_pretok.py``)
and, through :meth:`motor.coordinator.tokenize.RoutingTokenizer.encode_piece`, to the library's
ids (``tests/unit/coordinator/test_tokenize_cache.py``).
"""
from cpython.dict cimport PyDict_GetItemWithError
from cpython.list cimport (PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE, PyList_New,
                           PyList_SET_ITEM)
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_Substring
from libc.string cimport memchr, memcmp

from motor._fast.bpe cimport ByteLevelBpe

cdef extern from "Python.h":
    int PyUnicode_IS_ASCII(object) except -1
    int PyUnicode_KIND(object)
    Py_ssize_t PyUnicode_Find(object, object, Py_ssize_t, Py_ssize_t, int) except -2
    Py_ssize_t PyUnicode_Tailmatch(object, object, Py_ssize_t, Py_ssize_t, int) except -1
    const unsigned char *PyUnicode_1BYTE_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void *PyUnicode_DATA(object)
    void PyUnicode_WRITE(int kind, void *data, Py_ssize_t index, Py_UCS4 value)

# character classes of ASCII: letters, digits, the six white-space characters, the rest
cdef enum:
    C_LETTER = 0
    C_DIGIT = 1
    C_SPACE = 2
    C_OTHER = 3

cdef unsigned char _cls[128]


cdef void _init_classes() noexcept:
    cdef int c
    for c in range(128):
        if (c >= 65 and c <= 90) or (c >= 97 and c <= 122):
            _cls[c] = C_LETTER
        elif c >= 48 and c <= 57:
            _cls[c] = C_DIGIT
        elif c == 32 or (c >= 9 and c <= 13):
            _cls[c] = C_SPACE
        else:
            _cls[c] = C_OTHER


_init_classes()


cdef inline Py_ssize_t _word_end(const unsigned char *s, Py_ssize_t n,
                                 Py_ssize_t p) noexcept nogil:
    """End (exclusive) of the word starting at ``p < n`` of ASCII ``s[0:n]``."""
    cdef unsigned char c = s[p], d, e
    cdef unsigned char k = _cls[c]
    cdef Py_ssize_t q = p, r
    if c == 39 and p + 1 < n:                      # '
        d = s[p + 1]
        if d == 115 or d == 116 or d == 109 or d == 100:     # s t m d
            return p + 2
        if p + 2 < n:
            e = s[p + 2]
            if (e == 101 and (d == 114 or d == 118)) or (d == 108 and e == 108):  # re ve ll
                return p + 3
    if c == 32 and p + 1 < n and _cls[s[p + 1]] != C_SPACE:
        q = p + 1                                 # " ?" then the run after the space
        k = _cls[s[q]]
    if k != C_SPACE:
        r = q + 1
        while r < n and _cls[s[r]] == k:
            r += 1
        return r
    r = p + 1
    while r < n and _cls[s[r]] == C_SPACE:
        r += 1
    if r == n or r - p == 1:
        return r
    return r - 1


cdef inline const unsigned char *_ascii(str text, Py_ssize_t *n) except NULL:
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("text is expected to be ASCII")
    n[0] = PyUnicode_GET_LENGTH(text)
    return PyUnicode_1BYTE_DATA(text)


def split_ascii_words(str text):
    """The words (pre-tokens) of ASCII ``text``, in order (the module docstring's split).

    Returns
    -------
    list of str
        Non-empty words whose concatenation is ``text`` (empty list for empty text).

    Raises
    ------
    ValueError
        when ``text`` is not ASCII.
    """
    cdef Py_ssize_t n, p = 0, q
    cdef const unsigned char *s = _ascii(text, &n)
    out = []
    while p < n:
        q = _word_end(s, n, p)
        PyList_Append(out, PyUnicode_Substring(text, p, q))
        p = q
    return out


cdef class WordIds:
    """A direct-mapped table of recently seen words and their token ids, in front of the
    word cache (:func:`encode_ascii_words`): a word found here costs a hash of its bytes and
    a compare, no ``str`` object nor dict lookup.

    Each of ``slots`` (a power of two, >= 1) entries holds one word and its ids, replaced by
    the next word that hashes there (FNV-1a of the bytes). A word's ids never change for one
    tokenizer, so an entry is as good as the cache's; it holds references to both (at most
    ``slots`` words and lists).

    Raises
    ------
    ValueError
        when ``slots`` is not a power of two >= 1.
    """

    cdef Py_ssize_t mask
    cdef PyObject **keys
    cdef PyObject **vals

    def __cinit__(self, Py_ssize_t slots=4096):
        if slots < 1 or (slots & (slots - 1)):
            raise ValueError(f"slots is expected to be a power of two >= 1, got {slots}")
        self.keys = <PyObject **>calloc(slots, sizeof(PyObject *))
        self.vals = <PyObject **>calloc(slots, sizeof(PyObject *))
        if self.keys == NULL or self.vals == NULL:
            raise MemoryError()
        self.mask = slots - 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.keys != NULL and self.vals != NULL:
            for i in range(self.mask + 1):
                Py_XDECREF(self.keys[i])
                Py_XDECREF(self.vals[i])
        free(self.keys)
        free(self.vals)

    def __len__(self):
        cdef Py_ssize_t i, n = 0
        for i in range(self.mask + 1):
            if self.keys[i] != NULL:
                n += 1
        return n

    cdef inline Py_ssize_t _slot(self, const unsigned char *w, Py_ssize_t n) noexcept:
        cdef uint64_t h = 0xcbf29ce484222325ULL
        cdef Py_ssize_t i
        for i in range(n):
            h = (h ^ w[i]) * 0x100000001b3ULL
        return <Py_ssize_t>((h ^ (h >> 32)) & <uint64_t>self.mask)

    cdef inline object _get(self, Py_ssize_t i, const unsigned char *w, Py_ssize_t n):
        cdef PyObject *k = self.keys[i]
        if k != NULL and PyUnicode_GET_LENGTH(<object>k) == n \
                and memcmp(PyUnicode_1BYTE_DATA(<object>k), w, n) == 0:
            return <object>self.vals[i]
        return None

    cdef inline void _put(self, Py_ssize_t i, object word, object ids) noexcept:
        Py_XDECREF(self.keys[i])
        Py_XDECREF(self.vals[i])
        Py_INCREF(word)
        Py_INCREF(ids)
        self.keys[i] = <PyObject *>word
        self.vals[i] = <PyObject *>ids


def encode_ascii_words(str text, words, miss, WordIds front=None):
    """Token ids of ASCII ``text``: the ids of its words (:func:`split_ascii_words`)
    concatenated, each read from ``front`` (when given) or else from ``words.cur`` (a dict
    word -> list of ids) or, when not there, from ``miss(word)`` (which may replace
    ``words.cur``: it is read again after); a word not in ``front`` is put there.

    Returns
    -------
    list of int
        A new list.

    Raises
    ------
    ValueError
        when ``text`` is not ASCII; what ``miss`` raises.
    """
    cdef Py_ssize_t n, p = 0, q, i, k, total = 0, slot = 0
    cdef const unsigned char *s = _ascii(text, &n)
    cdef dict cur = words.cur
    cdef PyObject *got
    cdef list parts = []
    cdef list out
    while p < n:
        q = _word_end(s, n, p)
        ids = None
        if front is not None:
            slot = front._slot(s + p, q - p)
            ids = front._get(slot, s + p, q - p)
        if ids is None:
            w = PyUnicode_Substring(text, p, q)
            got = PyDict_GetItemWithError(cur, w)
            if got == NULL:
                ids = miss(w)
                cur = words.cur
            else:
                ids = <object>got
            if type(ids) is not list:
                ids = list(ids)
            if front is not None:
                front._put(slot, w, ids)
        total += PyList_GET_SIZE(ids)
        PyList_Append(parts, ids)
        p = q
    out = PyList_New(total)      # the exact size: no growth
    k = 0
    for ids in parts:
        for i in range(PyList_GET_SIZE(ids)):
            x = <object>PyList_GET_ITEM(ids, i)
            Py_INCREF(x)
            PyList_SET_ITEM(out, k, x)
            k += 1
    return out


def split_added(str text, str prefix, tuple names, dict ids):
    """``text`` cut at its added tokens: the text pieces between them (non-empty) and each
    token's id, in order. ``names``: the tokens, longest first, every one starting with
    ``prefix`` (not empty); ``ids``: token -> id.

    The same as ``re.split`` with the alternation of ``names`` in a capture group, empty
    pieces dropped: leftmost match first, there the longest token (the first of ``names``)
    that starts there; the scan goes on after it.

    Returns
    -------
    list of (str or int)

    Raises
    ------
    ValueError
        when ``prefix`` is empty; KeyError when a name has no id.
    """
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), start = 0, i, k, ln
    cdef Py_ssize_t np = PyUnicode_GET_LENGTH(prefix), nn = len(names)
    cdef list out = []
    cdef const unsigned char *s
    cdef const unsigned char *hit
    cdef const unsigned char *nm
    cdef bint narrow
    if np == 0:
        raise ValueError("prefix is expected to be non-empty")
    # one byte a character (ASCII, Latin-1) in the text and every name: memchr and memcmp
    narrow = PyUnicode_KIND(text) == 1 and PyUnicode_KIND(prefix) == 1
    for name in names:
        narrow = narrow and PyUnicode_KIND(<str>name) == 1
    if not narrow:
        return _split_added_wide(text, prefix, names, ids)
    s = PyUnicode_1BYTE_DATA(text)
    i = 0
    while i + np <= n:
        hit = <const unsigned char *>memchr(s + i, PyUnicode_1BYTE_DATA(prefix)[0],
                                           n - i)
        if hit == NULL:
            break
        i = hit - s
        for k in range(nn):
            name = <str>names[k]
            ln = PyUnicode_GET_LENGTH(name)
            nm = PyUnicode_1BYTE_DATA(name)
            if i + ln <= n and memcmp(s + i, nm, ln) == 0:
                if i > start:
                    PyList_Append(out, PyUnicode_Substring(text, start, i))
                PyList_Append(out, ids[name])
                start = i + ln
                i = start
                break
        else:
            i += 1
    if start < n:
        PyList_Append(out, text if start == 0 else PyUnicode_Substring(text, start, n))
    return out


cdef list _split_added_wide(str text, str prefix, tuple names, dict ids):
    """:func:`split_added` on text of any kind (str.find and startswith)."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), start = 0, i
    cdef list out = []
    i = PyUnicode_Find(text, prefix, 0, n, 1)
    while i >= 0:
        for name in names:
            if PyUnicode_Tailmatch(text, name, i, n, -1):
                if i > start:
                    PyList_Append(out, PyUnicode_Substring(text, start, i))
                PyList_Append(out, ids[name])
                start = i + PyUnicode_GET_LENGTH(name)
                i = PyUnicode_Find(text, prefix, start, n, 1) if start < n else -1
                break
        else:
            i = PyUnicode_Find(text, prefix, i + 1, n, 1) if i + 1 < n else -1
    if start < n:
        PyList_Append(out, text if start == 0 else PyUnicode_Substring(text, start, n))
    return out


cdef str _ID = "id"
cdef str _CUR = "cur"
cdef str _OLD = "old"


cdef class ByteLevelMiss:
    """The ids of a word missing from a word cache's current generation, for
    :func:`encode_ascii_words`'s ``miss``: from the cache's old generation (moved to the
    current one), else the BPE ``model``'s ``tokenize`` of the word's bytes in the
    byte-level alphabet (GPT-2's ``bytes_to_unicode`` on ASCII: 0x00-0x20 -> U+0100-U+0120,
    0x7F -> U+0121, every other byte itself), kept in the current one.

    ``words``: an object with ``cur`` and ``old`` (dict word -> list of ids) and
    ``max_words``: when ``cur`` holds ``max_words`` it becomes ``old`` (the older is
    dropped) and a new ``cur`` starts (:class:`motor.coordinator.tokenize.WordCache`'s
    rule). ``model``: a ``tokenizers`` model (``tokenize(str)`` -> tokens with ``id``);
    ``bpe``: that model's merges compiled (:class:`motor._fast.bpe.ByteLevelBpe`), used
    instead of ``model`` when given (``model`` still takes a word ``bpe`` has no token for).

    Calling it raises ValueError for a word that is not ASCII, and what ``model`` raises.
    """
    cdef object words
    cdef object model
    cdef ByteLevelBpe bpe
    cdef Py_ssize_t max_words

    def __init__(self, words, model, ByteLevelBpe bpe=None):
        self.words = words
        self.model = model
        self.bpe = bpe
        self.max_words = words.max_words

    cdef inline void _put(self, str word, list ids) except *:
        cdef dict cur = <dict?>getattr(self.words, _CUR)
        if len(cur) >= self.max_words:
            setattr(self.words, _OLD, cur)
            cur = {}
            setattr(self.words, _CUR, cur)
        cur[word] = ids

    def __call__(self, str word):
        cdef dict old = <dict?>getattr(self.words, _OLD)
        cdef Py_ssize_t n, i
        cdef const unsigned char *s
        cdef unsigned char c
        cdef bint wide
        got = old.pop(word, None)
        if got is not None:
            self._put(word, <list?>got)
            return got
        n = PyUnicode_GET_LENGTH(word)
        if not PyUnicode_IS_ASCII(word):
            raise ValueError("word is expected to be ASCII")
        if self.bpe is not None:
            got = self.bpe.encode_ascii(word)
            if got is not None:
                self._put(word, <list>got)
                return got
        s = PyUnicode_1BYTE_DATA(word)
        wide = False
        for i in range(n):
            if s[i] <= 0x20 or s[i] == 0x7F:
                wide = True
                break
        if not wide:        # the alphabet's characters are the word's own (a str is canonical)
            text = word
        else:
            text = PyUnicode_New(n, 0x121)
        for i in range(n if wide else 0):
            c = s[i]
            PyUnicode_WRITE(PyUnicode_KIND(text), PyUnicode_DATA(text), i,
                            0x100 + c if c <= 0x20 else (0x121 if c == 0x7F else c))
        toks = self.model.tokenize(text)
        cdef list ids = PyList_New(0)
        for t in toks:
            PyList_Append(ids, getattr(t, _ID))
        self._put(word, ids)
        return ids
