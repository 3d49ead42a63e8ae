# cython: language_level=3
"""What the request path reads of an inference request's body, without parsing it.

A proxied request needs, before it is sent, four things of its JSON body: ``model``,
whether ``stream`` is ``true``, the answer's length bound (``max_completion_tokens`` /
``max_tokens``, for load accounting) and, for a chat, that ``messages`` is a non-empty
array. ``orjson.loads`` of a 1 KB chat body makes a dict, the message dicts and a 1 KB
``str`` to read those (~11 k instructions, ~2 us, each freed again); most requests (round
robin, least load, a non-streamed answer) never read the rest. :func:`scan_request` walks
the bytes once with the strict grammar of :mod:`motor._fast.jsongrammar` (every byte is
checked: a document it takes is one ``orjson`` parses) and reads those members' values
in place. The caller parses the body with ``orjson`` only when something needs it
(:class:`motor.coordinator.routing.base.Parsed`'s ``body``).

It answers ``None`` (the caller parses the body and checks it as before, which also words
the errors) for anything it does not decide itself:

* bytes the grammar does not take (invalid JSON, or outside the grammar's bounds: see
  :mod:`motor._fast.jsongrammar`), or a document that is not an object;
* a member name with an escape (it could spell a member read here);
* ``model`` neither a string without escapes nor ``null``;
* a chat (``chat=True``) whose ``messages`` is not a non-empty array;
* a ``prompt`` that is an array (a token-id prompt: its length is the prompt's size).

A member given twice counts with its last value, as in the dict ``orjson`` makes.
"""
from libc.stdint cimport int64_t
from libc.string cimport memcmp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8

from motor._fast.jsongrammar cimport (CH_0, CH_9, CH_COLON, CH_COMMA, CH_DOT, CH_LBRACE,
                                      CH_LBRACKET, CH_LOWER_E, CH_MINUS, CH_QUOTE, CH_RBRACE,
                                      CH_RBRACKET, CH_UPPER_E, json_skip, json_string,
                                      json_ws)


cdef enum:                   # a length bound's value
    V_ABSENT = 0             # no such member
    V_NULL = 1               # null
    V_INT = 2                # an integer (no fraction, no exponent)
    V_OTHER = 3              # anything else (a float, a string, a boolean, ...)


cdef inline bint _is(const unsigned char *k, Py_ssize_t n, const char *name,
                     Py_ssize_t m) noexcept nogil:
    return n == m and memcmp(k, name, m) == 0


#: the members a stream's set-up reads besides the length bound: what
#: ``motor.coordinator.recovery.continuable`` refuses a stream for, and what
#: ``StreamRecovery`` and ``inject_token_ids`` read (a test keeps them equal)
_STREAM_KEY_BYTES = (b"n", b"best_of", b"logprobs", b"top_logprobs", b"prompt_logprobs",
                     b"echo", b"stop", b"tools", b"functions", b"response_format",
                     b"structured_outputs", b"guided_json", b"guided_regex", b"guided_choice",
                     b"guided_grammar", b"return_token_ids", b"stream_options", b"min_tokens")
STREAM_KEYS = frozenset(k.decode() for k in _STREAM_KEY_BYTES)
cdef enum:
    N_STREAM_KEYS = 18
if len(_STREAM_KEY_BYTES) != N_STREAM_KEYS:
    raise ImportError(f"reqscan: {len(_STREAM_KEY_BYTES)} stream keys, room for {N_STREAM_KEYS}")
cdef const char *_KEY[N_STREAM_KEYS]
cdef Py_ssize_t _KEY_LEN[N_STREAM_KEYS]
for _j, _k in enumerate(_STREAM_KEY_BYTES):     # the tuple keeps the bytes alive
    _KEY[_j] = PyBytes_AS_STRING(_k)
    _KEY_LEN[_j] = PyBytes_GET_SIZE(_k)


cdef bint _stream_key(const unsigned char *k, Py_ssize_t n) noexcept nogil:
    cdef int j
    for j in range(N_STREAM_KEYS):
        if _is(k, n, _KEY[j], _KEY_LEN[j]):
            return True
    return False


cdef int _bound(const unsigned char *p, Py_ssize_t vs, Py_ssize_t ve,
                int64_t *v) noexcept nogil:
    """The kind of the value ``p[vs:ve]`` (valid JSON); an integer's value in ``v``."""
    cdef Py_ssize_t i = vs
    cdef bint neg = False
    cdef int64_t x = 0
    cdef unsigned char c = p[vs]
    if c == 110:             # n: null
        return V_NULL
    if c != CH_MINUS and not (CH_0 <= c <= CH_9):
        return V_OTHER
    for i in range(vs, ve):
        c = p[i]
        if c == CH_DOT or c == CH_LOWER_E or c == CH_UPPER_E:
            return V_OTHER   # a float in the dict, never an int
    i = vs
    if p[i] == CH_MINUS:
        neg = True
        i += 1
    while i < ve:            # at most 18 digits (the grammar's bound): no overflow
        x = x * 10 + (p[i] - CH_0)
        i += 1
    v[0] = -x if neg else x
    return V_INT


def scan_request(bytes raw, bint chat):
    """``(model, stream, max_tokens, plain, bound)`` of a request body, or ``None`` (the
    module docstring says when; the caller then parses the body).

    Parameters
    ----------
    raw : bytes
        The request's body, as the client sent it.
    chat : bool
        ``/v1/chat/completions`` (the bound is ``max_completion_tokens``, else
        ``max_tokens``; ``messages`` must be a non-empty array), else a route whose bound
        is ``max_tokens``.

    Returns
    -------
    tuple (str | None, bool, int, bool, int | None) or None
        ``model`` (``None``: absent or ``null``); ``stream`` is ``true``; the bound as
        :func:`motor.protocol.openai.max_tokens_of` reads the parsed body (0 when absent,
        not an integer or not positive); ``plain``: none of :data:`STREAM_KEYS` is there
        and the bound's value (:func:`motor.protocol.openai.max_tokens_field`) is an
        integer or none, so a stream's failover is set up from the bound alone; that
        value (``None``: absent or ``null``; ``None`` too when not ``plain``).
    """
    cdef const unsigned char *p
    cdef Py_ssize_t n, i, ks, ke, vs, ve, j
    cdef bint esc, vesc
    cdef bint stream = False, messages_ok = False, prompt_array = False, other = False
    cdef Py_ssize_t model_s = -1, model_e = -1
    cdef int mt = V_ABSENT, mct = V_ABSENT, use
    cdef int64_t mt_v = 0, mct_v = 0, val
    if raw is None:
        return None
    p = <const unsigned char *>PyBytes_AS_STRING(raw)   # p[n] is the NUL of the bytes
    n = PyBytes_GET_SIZE(raw)
    i = json_ws(p, 0, n)
    if i >= n or p[i] != CH_LBRACE:
        return None
    i = json_ws(p, i + 1, n)
    if i < n and p[i] == CH_RBRACE:
        i += 1
    else:
        while True:
            if i >= n or p[i] != CH_QUOTE:
                return None
            esc = False
            ke = json_string(p, i, n, &esc)
            if ke < 0 or esc:
                return None
            ks = i + 1
            i = json_ws(p, ke, n)
            if i >= n or p[i] != CH_COLON:
                return None
            vs = json_ws(p, i + 1, n)
            if vs >= n:
                return None
            if p[vs] == CH_QUOTE:
                vesc = False
                ve = json_string(p, vs, n, &vesc)
            else:
                ve = json_skip(p, vs, n, 1)
            if ve < 0:
                return None
            ke -= 1              # the key's closing quote
            if _is(p + ks, ke - ks, b"model", 5):
                if p[vs] == CH_QUOTE and not vesc:
                    model_s, model_e = vs + 1, ve - 1
                elif p[vs] == 110:      # null
                    model_s = model_e = -1
                else:
                    return None
            elif _is(p + ks, ke - ks, b"stream", 6):
                stream = p[vs] == 116   # t: true (the grammar checked the literal)
            elif _is(p + ks, ke - ks, b"max_tokens", 10):
                mt = _bound(p, vs, ve, &mt_v)
            elif _is(p + ks, ke - ks, b"max_completion_tokens", 21):
                mct = _bound(p, vs, ve, &mct_v)
            elif _is(p + ks, ke - ks, b"messages", 8):
                j = json_ws(p, vs + 1, n)
                messages_ok = p[vs] == CH_LBRACKET and p[j] != CH_RBRACKET
            elif _is(p + ks, ke - ks, b"prompt", 6):
                prompt_array = p[vs] == CH_LBRACKET
            elif not other and _stream_key(p + ks, ke - ks):
                other = True
            i = json_ws(p, ve, n)
            if i >= n:
                return None
            if p[i] == CH_COMMA:
                i = json_ws(p, i + 1, n)
                continue
            if p[i] == CH_RBRACE:
                i += 1
                break
            return None
    if json_ws(p, i, n) != n:
        return None
    if (chat and not messages_ok) or prompt_array:
        return None
    # max_tokens_field: a chat's max_completion_tokens unless absent or null
    if chat and mct != V_ABSENT and mct != V_NULL:
        use, val = mct, mct_v
    else:
        use, val = mt, mt_v
    model = None if model_s < 0 else PyUnicode_DecodeUTF8(
        <const char *>p + model_s, model_e - model_s, NULL)
    plain = not other and use != V_OTHER
    return (model, stream, (val if use == V_INT and val > 0 else 0), plain,
            val if plain and use == V_INT else None)
