# cython: language_level=3, boundscheck=False, wraparound=False
"""A spliced chat render's compiled steps (``motor.coordinator.chat_splice``): a chat's
message structure, and its plan (the text cut at the added tokens) without the text.

``shape_of(messages, flags)``: the structure key of :class:`SpliceCache` (``flags``, then per
message its role, or (role, name) when it has a name) and the contents in order; ``None``
when a message is not a dict of a string ``role`` and ``content`` and at most a string
``name`` besides (the chat is rendered whole).

``plan_of(seg_plans, idx, contents, prefix)``: the plan of the text ``segs[0] +
contents[idx[0]] + segs[1] + ...`` from each segment's own split (``seg_plans[k]``: the
added-token split of ``segs[k]``, :func:`motor._fast.pretok.split_added`): text elements
and contents run together into one piece up to the next token id, empty pieces dropped.
That is the split of the whole text when no piece holding a content holds ``prefix`` (the
tokens' common prefix): a token there could start inside a content or across a boundary.
Then it returns ``None`` and the caller splits the text itself. ``memo`` (a list the
caller keeps per structure) holds the last plan's pieces with a content: a piece equal to
one there is that object again, so a shared system prompt's piece is neither joined nor
hashed again (``str`` caches its hash) and the piece cache finds it by identity.
"""
from cpython.dict cimport PyDict_GetItem, PyDict_Size
from cpython.list cimport PyList_Append
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_SIZE
from cpython.unicode cimport PyUnicode_GET_LENGTH, PyUnicode_Join

from libc.string cimport memchr, memcmp

cdef extern from "Python.h":
    Py_ssize_t PyUnicode_Find(object s, object sub, Py_ssize_t start, Py_ssize_t end,
                              int direction) except -2
    int PyUnicode_KIND(object o)
    void *PyUnicode_DATA(object o)
    Py_UCS4 PyUnicode_READ(int kind, const void *data, Py_ssize_t index)
    const unsigned char *PyUnicode_1BYTE_DATA(object o)

cdef str _ROLE = "role"
cdef str _CONTENT = "content"
cdef str _NAME = "name"
cdef str _EMPTY = ""


def shape_of(list messages, object flags):
    """(structure key tuple, contents list) of ``messages``, or ``None`` (not spliceable)."""
    return _shape_of(messages, flags)


#: what :func:`plan_known` answers for a structure not seen yet (or whose segments are not
#: split yet): the caller's general path makes it
NOT_KNOWN = object()


def plan_known(dict shapes not None, list messages not None, object flags, str prefix not None,
               object missing):
    """:meth:`motor.coordinator.chat_splice.SpliceCache.plan` for a structure it holds, in
    one call: :func:`shape_of`, the structure's entry in ``shapes`` (key -> an object with
    ``splits``, ``idx``, ``memo``), then :func:`plan_of`.

    Returns
    -------
    list, None or NOT_KNOWN
        The plan; ``None`` when the chat is not spliceable, its structure does not cut
        cleanly (``splits`` None) or a piece with a content holds ``prefix``;
        :data:`NOT_KNOWN` when ``shapes`` has no entry for the structure or its ``splits``
        is ``missing`` (not made yet).

    Raises
    ------
    ValueError, TypeError
        as :func:`plan_of`.
    """
    got = _shape_of(messages, flags)
    if got is None:
        return None
    key, contents = <tuple>got
    cdef PyObject *sh = PyDict_GetItem(shapes, key)
    if sh == NULL:
        return NOT_KNOWN
    splits = (<object>sh).splits
    if splits is missing:
        return NOT_KNOWN
    if splits is None:
        return None
    return _plan_of(<tuple?>splits, <tuple?>(<object>sh).idx, <list>contents, prefix,
                    <list?>(<object>sh).memo)


cdef object _shape_of(list messages, object flags):
    cdef list shape = [flags]
    cdef list contents = []
    cdef PyObject *c
    cdef PyObject *r
    cdef PyObject *nm
    cdef Py_ssize_t n
    for m in messages:
        if type(m) is not dict:
            return None
        c = PyDict_GetItem(<dict>m, _CONTENT)
        r = PyDict_GetItem(<dict>m, _ROLE)
        if c == NULL or r == NULL or type(<object>c) is not str or type(<object>r) is not str:
            return None
        n = PyDict_Size(<dict>m)
        if n == 2:                          # role and content, nothing else
            PyList_Append(shape, <object>r)
        else:
            nm = PyDict_GetItem(<dict>m, _NAME)
            if n != 3 or nm == NULL or type(<object>nm) is not str:
                return None
            PyList_Append(shape, (<object>r, <object>nm))
        PyList_Append(contents, <object>c)
    return tuple(shape), contents


cdef inline bint _holds(str text, str sub) except -1:
    """``sub in text``: ``memchr`` of its first character then ``memcmp`` when both are one
    byte a character (a chat's ASCII or Latin-1 text), ``str.find`` otherwise."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), m = PyUnicode_GET_LENGTH(sub), i = 0
    cdef const unsigned char *s
    cdef const unsigned char *p
    cdef const unsigned char *hit
    if PyUnicode_KIND(text) != 1 or PyUnicode_KIND(sub) != 1:
        return PyUnicode_Find(text, sub, 0, n, 1) >= 0
    s = PyUnicode_1BYTE_DATA(text)
    p = PyUnicode_1BYTE_DATA(sub)
    while i + m <= n:
        hit = <const unsigned char *>memchr(s + i, p[0], n - m - i + 1)
        if hit == NULL:
            return False
        i = hit - s
        if memcmp(s + i, p, m) == 0:
            return True
        i += 1
    return False


cdef inline bint _same(str m, list parts) except -1:
    """Whether ``m`` is the concatenation of ``parts``: ``memcmp`` of a part as wide as
    ``m`` (one, two or four bytes a character), character by character otherwise (a
    narrower template text before a wide content)."""
    cdef Py_ssize_t total = 0, off = 0, ln, c
    cdef int kind = PyUnicode_KIND(m), pkind
    cdef const char *base
    cdef const void *pdata
    for p in parts:
        total += PyUnicode_GET_LENGTH(<str>p)
    if total != PyUnicode_GET_LENGTH(m):
        return False
    base = <const char *>PyUnicode_DATA(m)
    for p in parts:
        ln = PyUnicode_GET_LENGTH(<str>p)
        if ln == 0:
            continue
        pkind = PyUnicode_KIND(p)
        pdata = PyUnicode_DATA(p)
        if pkind == kind:
            if memcmp(base + off * kind, pdata, ln * kind) != 0:
                return False
        else:
            for c in range(ln):
                if PyUnicode_READ(kind, base, off + c) != PyUnicode_READ(pkind, pdata, c):
                    return False
        off += ln
    return True


cdef inline bint _flush(list out, list pending, bint has_content, str prefix, list memo,
                        Py_ssize_t *j) except -1:
    """Append ``pending``'s text as one piece (not when empty); False when it holds a
    content and ``prefix``. A piece with a content: ``memo[j]`` is the same piece of the
    structure's last plan, taken again when equal (its hash is known, a dict finds it by
    identity: a system prompt's piece is not copied nor hashed again), else replaced."""
    cdef Py_ssize_t n = len(pending)
    if n == 0:
        return True
    if has_content and memo is not None:
        if j[0] < len(memo):
            m = memo[j[0]]
            if _same(<str>m, pending):
                PyList_Append(out, m)
                j[0] += 1
                return True
    piece = pending[0] if n == 1 else PyUnicode_Join(_EMPTY, pending)
    if PyUnicode_GET_LENGTH(piece) == 0:
        return True
    if has_content:
        if _holds(piece, prefix):
            return False
        if memo is not None:
            if j[0] < len(memo):
                memo[j[0]] = piece
            else:
                PyList_Append(memo, piece)
            j[0] += 1
    PyList_Append(out, piece)
    return True


def plan_of(tuple seg_plans, tuple idx, list contents, str prefix, list memo=None):
    """The plan (list of str pieces and int token ids) of the spliced text, or ``None``
    (a piece with a content holds ``prefix``). ``len(seg_plans) == len(idx) + 1``; each
    ``idx[k]`` indexes ``contents``. ``memo``: the structure's pieces with a content of the
    last call (kept by the caller, updated here): an equal piece is that same object.

    Raises
    ------
    ValueError
        when ``prefix`` is empty, the lengths do not fit or an index is out of range;
        TypeError when a segment's plan is not a tuple.
    """
    return _plan_of(seg_plans, idx, contents, prefix, memo)


cdef object _plan_of(tuple seg_plans, tuple idx, list contents, str prefix, list memo):
    cdef Py_ssize_t k, i, j = 0, n = PyTuple_GET_SIZE(idx), nc = len(contents)
    cdef list out = []
    cdef list pending = []
    cdef bint has_content = False
    if PyUnicode_GET_LENGTH(prefix) == 0:
        raise ValueError("prefix is expected to be non-empty")
    if PyTuple_GET_SIZE(seg_plans) != n + 1:
        raise ValueError(f"seg_plans is expected to hold {n + 1} segments, got "
                         f"{PyTuple_GET_SIZE(seg_plans)}")
    for k in range(n + 1):
        for el in <tuple?>seg_plans[k]:
            if type(el) is str:
                PyList_Append(pending, el)
            else:
                if not _flush(out, pending, has_content, prefix, memo, &j):
                    return None
                pending = []
                has_content = False
                PyList_Append(out, el)
        if k < n:
            i = idx[k]
            if i < 0 or i >= nc:
                raise ValueError(f"idx[{k}] is expected to index contents (0..{nc - 1}), got {i}")
            PyList_Append(pending, contents[i])
            has_content = True
    if not _flush(out, pending, has_content, prefix, memo, &j):
        return None
    return out
