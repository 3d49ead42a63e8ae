# cython: language_level=3, boundscheck=False, wraparound=False
"""A byte-level BPE model's merges applied to an ASCII word, compiled: the ids the
``tokenizers`` BPE model gives one pre-token (``Model.tokenize``), without its Python
objects (a list of ``Token`` objects, ~7 k instructions a word through the library's
binding, against a few hundred here).

The model (``tokenizer.json``'s ``model``, type ``BPE``; ``tokenizers``
``models/bpe/model.rs`` and ``word.rs``): the word's characters in the byte-level alphabet
(GPT-2's ``bytes_to_unicode``: on ASCII, 0x00-0x20 -> U+0100-U+0120, 0x7F -> U+0121,
every other byte itself), each one token of the vocabulary; then, while two adjacent
tokens form a pair of the merge list, the pair of lowest rank (its place in the list; the
leftmost of equal ones) becomes the token ``vocab[a + b]``. With ``ignore_merges`` a word
that is a token of the vocabulary as a whole is that token. A merge listed twice keeps its
last rank (the library builds a map from the list). Options this does not do (a
continuing-subword prefix, an end-of-word suffix, dropout) are the caller's to refuse.
"""
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLong
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc

cdef extern from "Python.h":
    int PyUnicode_IS_ASCII(object) except -1
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    const unsigned char *PyUnicode_1BYTE_DATA(object)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    int PyUnicode_KIND(object)
    void *PyUnicode_DATA(object)
    void PyUnicode_WRITE(int kind, void *data, Py_ssize_t index, Py_UCS4 value)

cdef uint32_t NO_RANK = 0xFFFFFFFF
cdef enum:
    STACK_WORD = 64         # words up to this long are merged in arrays on the stack
    MAX_WORD = 256          # longer words are left to the library (see encode)


cdef inline uint64_t _slot(uint64_t key, uint64_t mask) noexcept nogil:
    cdef uint64_t h = key * <uint64_t>0x9E3779B97F4A7C15ULL
    return (h ^ (h >> 29)) & mask


cdef inline Py_UCS4 _alphabet(unsigned char c) noexcept nogil:
    """An ASCII byte's character in the byte-level alphabet."""
    if c <= 0x20:
        return 0x100 + c
    if c == 0x7F:
        return 0x121
    return c


def byte_level(str word):
    """``word`` (ASCII) in the byte-level alphabet: what the BPE model sees of it.

    Raises
    ------
    ValueError
        when ``word`` is not ASCII.
    """
    if not PyUnicode_IS_ASCII(word):
        raise ValueError("word is expected to be ASCII")
    return _byte_level(word)


cdef str _byte_level(str word):
    cdef Py_ssize_t i, n = PyUnicode_GET_LENGTH(word)
    cdef const unsigned char *s = PyUnicode_1BYTE_DATA(word)
    cdef bint wide = False
    for i in range(n):
        if s[i] <= 0x20 or s[i] == 0x7F:
            wide = True
            break
    if not wide:
        return word
    text = PyUnicode_New(n, 0x121)
    for i in range(n):
        PyUnicode_WRITE(PyUnicode_KIND(text), PyUnicode_DATA(text), i, _alphabet(s[i]))
    return text


cdef class ByteLevelBpe:
    """The merges of a byte-level BPE model, for ASCII words (the module docstring).

    Parameters
    ----------
    vocab : dict of str -> int
        The model's vocabulary (``model.vocab`` of ``tokenizer.json``); ids in 0..2**31-1.
    merges : sequence of str or of (str, str)
        ``model.merges`` in rank order: ``"a b"`` (the older format) or ``[a, b]``.
    ignore_merges : bool
        ``model.ignore_merges``.

    Raises
    ------
    ValueError
        when a merge is not two tokens, or a merge's token or its result is not in
        ``vocab`` (the library refuses such a model too), or an id is out of range, or two
        tokens have one id (the library loads such a vocabulary, and then tells a merge
        gone stale by its result's id alone: its ids would differ from these).

    Memory: a table of 16 bytes a slot, at least twice the merges (Qwen2's 151 k merges:
    8 MiB).
    """

    def __cinit__(self):
        self.table = NULL
        self.mask = 0

    def __init__(self, dict vocab not None, merges, bint ignore_merges=False):
        cdef Py_ssize_t n = len(merges), cap = 16, i
        cdef int c
        cdef object a, b
        cdef Py_ssize_t ia, ib, nid
        if len(set(vocab.values())) != len(vocab):
            raise ValueError("vocab is expected to give every token its own id")
        self.vocab = vocab
        self.ignore_merges = ignore_merges
        while cap < 2 * n:
            cap *= 2
        free(self.table)
        self.table = <BpePair *>calloc(cap, sizeof(BpePair))
        if self.table == NULL:
            raise MemoryError()
        self.mask = cap - 1
        self.n_merges = 0
        for c in range(128):
            got = vocab.get(chr(_alphabet(c)))
            self.byte_id[c] = -1 if got is None else _id(got, "vocab")
        for i in range(n):
            m = merges[i]
            if isinstance(m, str):
                parts = (<str>m).split(" ")
            else:
                parts = list(m)
            if len(parts) != 2:
                raise ValueError(f"merges[{i}] is expected to be two tokens, got {m!r}")
            a, b = parts
            try:
                ia = _id(vocab[a], "vocab")
                ib = _id(vocab[b], "vocab")
                nid = _id(vocab[a + b], "vocab")
            except (KeyError, TypeError):
                raise ValueError(f"merges[{i}] ({m!r}) or its result is not in the "
                                 f"vocabulary") from None
            self._put(((<uint64_t>ia) << 32) | <uint64_t>ib, <uint32_t>i, <uint32_t>nid)

    def __dealloc__(self):
        free(self.table)

    cdef void _put(self, uint64_t key, uint32_t rank, uint32_t new_id) noexcept:
        cdef uint64_t j = _slot(key, self.mask)
        while self.table[j].rank1 != 0 and self.table[j].key != key:
            j = (j + 1) & self.mask
        if self.table[j].rank1 == 0:
            self.n_merges += 1
        self.table[j].key = key
        self.table[j].rank1 = rank + 1        # a merge listed again: its last rank
        self.table[j].new_id = new_id

    cdef uint32_t _rank(self, int32_t a, int32_t b, int32_t *new_id) noexcept nogil:
        """The merge of (a, b): its rank (``new_id`` set), or NO_RANK."""
        cdef uint64_t key = ((<uint64_t>a) << 32) | <uint64_t>b
        cdef uint64_t j = _slot(key, self.mask)
        while self.table[j].rank1 != 0:
            if self.table[j].key == key:
                new_id[0] = <int32_t>self.table[j].new_id
                return self.table[j].rank1 - 1
            j = (j + 1) & self.mask
        return NO_RANK

    def encode(self, str word not None):
        """The model's ids of ASCII ``word`` (one pre-token), or ``None`` when a character
        of it has no token (the library then applies the model's unknown-token rule) or the
        word is longer than 256 characters: each merge here scans the word's pairs again
        (quadratic; a few hundred instructions for a word of ordinary length), where the
        library keeps them in a heap, so a run of 200,000 letters (a DNA sequence, padding)
        is the library's (27 ms) and not seconds here.

        Raises
        ------
        ValueError
            when ``word`` is not ASCII.
        """
        if not PyUnicode_IS_ASCII(word):
            raise ValueError("word is expected to be ASCII")
        return self.encode_ascii(word)

    cdef object encode_ascii(self, str word):
        """:meth:`encode` of a word known to be ASCII."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(word), i, m, best
        cdef const unsigned char *s = PyUnicode_1BYTE_DATA(word)
        cdef int32_t ids_s[STACK_WORD]
        cdef int32_t nids_s[STACK_WORD]
        cdef uint32_t ranks_s[STACK_WORD]
        cdef int32_t *ids = ids_s
        cdef int32_t *nids = nids_s
        cdef uint32_t *ranks = ranks_s
        cdef uint32_t r
        cdef list out
        if n == 0:
            return []
        if n > MAX_WORD:
            return None
        if self.ignore_merges:
            whole = self.vocab.get(_byte_level(word))
            if whole is not None:
                return [whole]
        for i in range(n):
            if self.byte_id[s[i]] < 0:
                return None
        if n > STACK_WORD:
            ids = <int32_t *>malloc(n * sizeof(int32_t))
            nids = <int32_t *>malloc(n * sizeof(int32_t))
            ranks = <uint32_t *>malloc(n * sizeof(uint32_t))
            if ids == NULL or nids == NULL or ranks == NULL:
                free(ids); free(nids); free(ranks)
                raise MemoryError()
        try:
            for i in range(n):
                ids[i] = self.byte_id[s[i]]
            for i in range(n - 1):          # ranks[i]: the merge of (ids[i], ids[i + 1])
                ranks[i] = self._rank(ids[i], ids[i + 1], &nids[i])
            m = n
            while m > 1:
                best = -1
                r = NO_RANK
                for i in range(m - 1):
                    if ranks[i] < r:
                        r = ranks[i]
                        best = i
                if best < 0:
                    break
                ids[best] = nids[best]
                for i in range(best + 1, m - 1):       # drop ids[best + 1]
                    ids[i] = ids[i + 1]
                for i in range(best + 1, m - 2):       # and the pair that started there
                    ranks[i] = ranks[i + 1]
                    nids[i] = nids[i + 1]
                m -= 1
                if best > 0:
                    ranks[best - 1] = self._rank(ids[best - 1], ids[best], &nids[best - 1])
                if best < m - 1:
                    ranks[best] = self._rank(ids[best], ids[best + 1], &nids[best])
            out = PyList_New(m)
            for i in range(m):
                x = PyLong_FromLong(ids[i])
                Py_INCREF(x)
                PyList_SET_ITEM(out, i, x)
            return out
        finally:
            if ids != ids_s:
                free(ids); free(nids); free(ranks)


cdef Py_ssize_t _id(object v, str what) except -1:
    if type(v) is not int or not 0 <= v <= 0x7FFFFFFF:
        raise ValueError(f"{what} ids are expected to be ints in 0..2**31-1, got {v!r}")
    return v
