# cython: language_level=3, boundscheck=False, wraparound=False
"""A chat's plan against the routing tokenizer's piece cache, compiled.

A plan (:meth:`motor.coordinator.tokenize.RoutingTokenizer.chat_plan`) is a chat's text cut
at the tokenizer's added tokens: a list of text pieces (``str``) and added-token ids
(``int``), in order. The routing key needs, for every request: where the first text piece
the piece cache does not hold is (the cached prefix's end, and whether the new text is long
enough for the encode pool), and the ids of the plan from there on, read from the cache
(a piece not there is encoded and kept). Both were Python loops of about 0.5 us an element
(``Tokenizers.warm``, ``RoutingTokenizer.assemble``); here they are one C loop each.

The piece cache is a :class:`motor.coordinator.tokenize.TokenCache`: ``_d`` (an
``OrderedDict`` text -> list of ids, least recently used first), ``hits`` / ``misses``
counters and ``put(text, ids)`` (which bounds it).
"""
from cpython.dict cimport PyDict_Contains, PyDict_GetItemWithError
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_GET_LENGTH

cdef extern from "Python.h":
    int PyList_SetSlice(object lst, Py_ssize_t low, Py_ssize_t high, object itemlist) except -1


def plan_cut(list plan not None, pieces not None):
    """Where ``plan``'s cached prefix ends.

    Parameters
    ----------
    plan : list of (str | int)
        Text pieces and added-token ids.
    pieces : dict
        The piece cache's mapping (text -> ids); only membership is read.

    Returns
    -------
    (cut, chars) : (int, int)
        ``cut``: the index of the first text piece not in ``pieces`` (``len(plan)`` when
        every one is); ``chars``: the characters of all text pieces not in it.

    Raises
    ------
    TypeError
        when ``pieces`` is not a dict (an ``OrderedDict`` is one).
    """
    cdef Py_ssize_t i, n = PyList_GET_SIZE(plan), cut = -1, chars = 0
    cdef object p
    if not isinstance(pieces, dict):
        raise TypeError(f"pieces is expected to be a dict, got {type(pieces).__name__}")
    for i in range(n):
        p = <object>PyList_GET_ITEM(plan, i)
        if type(p) is str and not PyDict_Contains(pieces, p):
            chars += PyUnicode_GET_LENGTH(p)
            if cut < 0:
                cut = i
    return (cut if cut >= 0 else n), chars


def assemble(list plan not None, Py_ssize_t start, cache not None, encode_piece not None,
             list head=None):
    """The token ids of ``plan[start:]``, after ``head``'s.

    Each added-token id is taken as it is; each text piece's ids come from ``cache`` (moved
    to its most recent end, a hit counted) or, when not there, from ``encode_piece(text)``
    (kept with ``cache.put``, a miss counted), as
    :meth:`motor.coordinator.tokenize.RoutingTokenizer.assemble` did in Python.

    Parameters
    ----------
    plan : list of (str | int)
    start : int
        The first element taken (0 <= start <= len(plan)).
    cache : TokenCache
    encode_piece : callable
        ``encode_piece(text) -> list of int``.
    head : list of int, optional
        Ids put first (copied: the list is not changed).

    Returns
    -------
    list of int
        A new list.

    Raises
    ------
    IndexError
        when ``start`` is out of range.
    What ``encode_piece`` and ``cache.put`` raise.
    """
    cdef Py_ssize_t i, n = PyList_GET_SIZE(plan), hits = 0
    cdef list out = [] if head is None else list(head)
    cdef list ids
    cdef PyObject *got
    cdef object p
    if start < 0 or start > n:
        raise IndexError(f"start is expected in 0..{n}, got {start}")
    d = cache._d
    if not isinstance(d, dict):
        raise TypeError(f"cache._d is expected to be a dict, got {type(d).__name__}")
    move = d.move_to_end
    try:
        for i in range(start, n):
            p = <object>PyList_GET_ITEM(plan, i)
            if type(p) is not str:
                PyList_Append(out, p)
                continue
            got = PyDict_GetItemWithError(d, p)
            if got == NULL:
                cache.misses += 1
                ids = encode_piece(p)
                cache.put(p, ids)
            else:
                ids = <list?><object>got
                move(p)
                hits += 1
            PyList_SetSlice(out, PyList_GET_SIZE(out), PyList_GET_SIZE(out), ids)
    finally:
        if hits:
            cache.hits += hits
    return out
