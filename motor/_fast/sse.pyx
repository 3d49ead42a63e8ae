# cython: language_level=3
"""The SSE relay of the first leg of a recoverable stream, without a JSON parse per event.

Mid-stream failover (``motor/coordinator/recovery.py``, ``docs/faults.md``) needs, from
every event of an engine's stream: the generated token ids (``choices[0].token_ids``), the
prompt's token ids (chat: top-level ``prompt_token_ids``; completions:
``choices[0].prompt_token_ids``), whether the stream finished (``finish_reason``), the
usage chunk and ``[DONE]``; and the client must not see the token-id fields it did not ask
for. :class:`EventScanner` does that on the bytes: a strict scanner of the JSON grammar
walks each ``data:`` event once, records the byte spans of the members it knows, parses
the token-id arrays into C buffers, and cuts the fields out of the bytes (no decode, no
re-encode). It makes the decisions of ``StreamRecovery._event`` for the first leg
(``leg == 0``) and applies them to the stream state it holds.

Anything it does not fully understand sends the **whole block** back to the caller's JSON
path, with nothing recorded: invalid JSON, a key with an escape, a duplicated known key,
a string escape of a UTF-16 surrogate, an integer part longer than 18 digits, an exponent
longer than 2 digits, nesting deeper than 64, more than 48 members in one object, an
event of several lines, a payload that is not an object, ``error`` events, several
choices, ``stop_reason: "recomputed"``, a ``finish_reason`` that is not a plain string,
token ids that are not non-negative integers, ``[DONE]`` before a finishing chunk,
``text`` / ``content`` that are not strings, a ``delta`` or ``choices`` of another type.

Grammar accepted (RFC 8259, checked as it goes): whitespace is space, tab, CR; strings
are valid UTF-8 (no overlong form, no surrogate, at most U+10FFFF) without control
characters; escapes ``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``; numbers
``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``; ``true``, ``false``, ``null``.

A cut member takes its separator with it: a run of cut members preceded by a kept one is
cut from the end of that kept member's value to the end of the run's last value; a run at
the start of its object is cut from its first key to the next kept member's key; a whole
object's members leave ``{}``. What the client gets therefore parses to the same JSON
as the JSON path's ``orjson.dumps`` of the edited object (bytes differ only where the
JSON path re-encodes).
"""
from libc.stdint cimport int64_t
from libc.string cimport memcmp, memchr, memcpy, memset
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DecodeUTF8

from motor._fast._common cimport MOTOR_DEBUG, mf_likely, mf_unlikely
from motor._fast.jsongrammar cimport (CH_0, CH_1, CH_9, CH_BACKSLASH, CH_COLON, CH_COMMA,
                                        CH_LBRACE, CH_LBRACKET, CH_LF, CH_QUOTE, CH_RBRACE,
                                        CH_RBRACKET, JSON_MAX_INT_DIGITS, json_skip,
                                        json_string, json_ws)

#: True when compiled with ``-DMOTOR_DEBUG=1``.
DEBUG = bool(MOTOR_DEBUG)


# -- the grammar: motor._fast.jsongrammar -------------------------------------------


cdef inline int _kind(unsigned char c) noexcept nogil:
    if c == CH_QUOTE:
        return SSE_KIND_STRING
    if c == CH_LBRACE:
        return SSE_KIND_OBJECT
    if c == CH_LBRACKET:
        return SSE_KIND_ARRAY
    if c == 110:
        return SSE_KIND_NULL
    if c == 116 or c == 102:
        return SSE_KIND_BOOL
    return SSE_KIND_NUMBER


cdef inline bint _eq(const unsigned char *k, Py_ssize_t n, const char *name,
                     Py_ssize_t m) noexcept nogil:
    return n == m and memcmp(k, name, m) == 0


cdef int _key(int level, const unsigned char *k, Py_ssize_t n) noexcept nogil:
    """The known key ``k[:n]`` (without quotes) names at ``level``, else SSE_KEY_OTHER."""
    if level == SSE_LEVEL_TOP:
        if _eq(k, n, b"id", 2):
            return SSE_KEY_ID
        if _eq(k, n, b"choices", 7):
            return SSE_KEY_CHOICES
        if _eq(k, n, b"created", 7):
            return SSE_KEY_CREATED
        if _eq(k, n, b"model", 5):
            return SSE_KEY_MODEL
        if _eq(k, n, b"usage", 5):
            return SSE_KEY_USAGE
        if _eq(k, n, b"error", 5):
            return SSE_KEY_ERROR
        if _eq(k, n, b"prompt_token_ids", 16):
            return SSE_KEY_PROMPT_TOKEN_IDS
        if _eq(k, n, b"prompt_text", 11):
            return SSE_KEY_PROMPT_TEXT
    elif level == SSE_LEVEL_CHOICE:
        if _eq(k, n, b"delta", 5):
            return SSE_KEY_DELTA
        if _eq(k, n, b"text", 4):
            return SSE_KEY_TEXT
        if _eq(k, n, b"token_ids", 9):
            return SSE_KEY_TOKEN_IDS
        if _eq(k, n, b"finish_reason", 13):
            return SSE_KEY_FINISH_REASON
        if _eq(k, n, b"stop_reason", 11):
            return SSE_KEY_STOP_REASON
        if _eq(k, n, b"prompt_token_ids", 16):
            return SSE_KEY_PROMPT_TOKEN_IDS
        if _eq(k, n, b"prompt_text", 11):
            return SSE_KEY_PROMPT_TEXT
    else:
        if _eq(k, n, b"content", 7):
            return SSE_KEY_CONTENT
        if _eq(k, n, b"role", 4):
            return SSE_KEY_ROLE
        if (_eq(k, n, b"reasoning_content", 17) or _eq(k, n, b"tool_calls", 10)
                or _eq(k, n, b"reasoning", 9)):
            return SSE_KEY_REASONING
    return SSE_KEY_OTHER


cdef int _push(SseIds *b, int64_t x) except -1:
    cdef Py_ssize_t cap
    cdef int64_t *v
    if mf_unlikely(b.n == b.cap):
        cap = 256 if b.cap == 0 else 2 * b.cap
        v = <int64_t *>PyMem_Realloc(b.v, cap * sizeof(int64_t))
        if v == NULL:
            raise MemoryError()
        b.v = v
        b.cap = cap
    b.v[b.n] = x
    b.n += 1
    return 0


cdef Py_ssize_t _ints(const unsigned char *p, Py_ssize_t i, Py_ssize_t n,
                      SseIds *out) except -2:
    """``p[i]`` opens an array: its non-negative integers appended to ``out``; the offset
    after the array, -1 when it holds anything else."""
    cdef int64_t v
    cdef Py_ssize_t s
    i = json_ws(p, i + 1, n)
    if i < n and p[i] == CH_RBRACKET:
        return i + 1
    while True:
        if i >= n:
            return -1
        if p[i] == CH_0:
            v = 0
            i += 1
        elif CH_1 <= p[i] <= CH_9:
            s = i
            v = 0
            while i < n and CH_0 <= p[i] <= CH_9:
                v = v * 10 + (p[i] - CH_0)
                i += 1
                if i - s > JSON_MAX_INT_DIGITS:
                    return -1
        else:
            return -1
        _push(out, v)
        i = json_ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == CH_COMMA:
            i = json_ws(p, i + 1, n)
            continue
        if p[i] == CH_RBRACKET:
            return i + 1
        return -1


cdef inline void _reset(SseObject *o) noexcept nogil:
    o.n = 0
    memset(o.at, 0xFF, sizeof(o.at))      # every int -1


cdef Py_ssize_t _object(const unsigned char *p, Py_ssize_t i, Py_ssize_t n, SseObject *o,
                        int level, SseEvent *ev, SseIds *ids, SseIds *pids) except -2:
    """``p[i]`` opens the object of ``level``: its members recorded in ``o`` (known keys
    in ``o.at``, token-id arrays parsed, ``choices[0]`` and its ``delta`` walked); the
    offset after it, -1 when not understood."""
    cdef Py_ssize_t ks, vs
    cdef int key, m
    cdef bint esc
    cdef unsigned char c
    _reset(o)
    i = json_ws(p, i + 1, n)
    if i < n and p[i] == CH_RBRACE:
        return i + 1
    while True:
        if i >= n or p[i] != CH_QUOTE:
            return -1
        ks = i
        esc = False
        i = json_string(p, i, n, &esc)
        if i < 0 or esc:                  # an escaped key could spell a known one
            return -1
        key = _key(level, p + ks + 1, i - ks - 2)
        m = o.n
        if m >= SSE_MAX_MEMBERS:
            return -1
        if key != SSE_KEY_OTHER:
            if o.at[key] >= 0 and key != SSE_KEY_REASONING:
                return -1                 # a duplicated known key: the last one counts
            o.at[key] = m
        i = json_ws(p, i, n)
        if i >= n or p[i] != CH_COLON:
            return -1
        i = json_ws(p, i + 1, n)
        if i >= n:
            return -1
        vs = i
        c = p[i]
        if key == SSE_KEY_CHOICES and c == CH_LBRACKET:
            i = json_ws(p, i + 1, n)
            if i < n and p[i] == CH_RBRACKET:
                ev.choices = SSE_CHOICES_EMPTY
                i += 1
            elif i < n and p[i] == CH_LBRACE:
                i = _object(p, i, n, &ev.choice, SSE_LEVEL_CHOICE, ev, ids, pids)
                if i < 0:
                    return i
                i = json_ws(p, i, n)
                if i >= n or p[i] != CH_RBRACKET:
                    return -1             # several choices (or not an array)
                ev.choices = SSE_CHOICES_ONE
                i += 1
            else:
                return -1
        elif key == SSE_KEY_DELTA and c == CH_LBRACE:
            i = _object(p, i, n, &ev.delta, SSE_LEVEL_DELTA, ev, ids, pids)
        elif key == SSE_KEY_TOKEN_IDS and c == CH_LBRACKET:
            ev.tids_a = ids.n
            i = _ints(p, i, n, ids)
            ev.tids_b = ids.n
        elif key == SSE_KEY_PROMPT_TOKEN_IDS and c == CH_LBRACKET:
            if level == SSE_LEVEL_TOP:
                ev.tp_a = pids.n
                i = _ints(p, i, n, pids)
                ev.tp_b = pids.n
            else:
                ev.cp_a = pids.n
                i = _ints(p, i, n, pids)
                ev.cp_b = pids.n
        else:
            i = json_skip(p, i, n, 1)
        if i < 0:
            return i
        o.m[m].key = ks
        o.m[m].vstart = vs
        o.m[m].vend = i
        o.m[m].kind = _kind(c)
        o.n = m + 1
        i = json_ws(p, i, n)
        if i >= n:
            return -1
        if p[i] == CH_COMMA:
            i = json_ws(p, i + 1, n)
            continue
        if p[i] == CH_RBRACE:
            return i + 1
        return -1


cdef int _cuts(const SseObject *o, unsigned long long mask, SseCuts *cuts) noexcept nogil:
    """Add the byte ranges that remove the members of ``o`` whose bit is set in ``mask``
    (separators included, see the module docstring); -1 when there are too many."""
    cdef int i = 0, j
    while i < o.n:
        if not (mask >> i) & 1:
            i += 1
            continue
        j = i
        while j + 1 < o.n and (mask >> (j + 1)) & 1:
            j += 1
        if cuts.n >= SSE_MAX_CUTS:
            return -1
        if i > 0:
            cuts.a[cuts.n] = o.m[i - 1].vend
            cuts.b[cuts.n] = o.m[j].vend
        elif j + 1 < o.n:
            cuts.a[cuts.n] = o.m[0].key
            cuts.b[cuts.n] = o.m[j + 1].key
        else:
            cuts.a[cuts.n] = o.m[0].key
            cuts.b[cuts.n] = o.m[j].vend
        cuts.n += 1
        i = j + 1
    return 0


cdef inline unsigned long long _bit(const SseObject *o, int key) noexcept nogil:
    return (1ULL << o.at[key]) if o.at[key] >= 0 else 0ULL


cdef inline int _kind_of(const SseObject *o, int key) noexcept nogil:
    """The kind of a known member's value, 0 when absent."""
    return o.m[o.at[key]].kind if o.at[key] >= 0 else 0


cdef inline bint _plain(const unsigned char *p, const SseMember *m) noexcept nogil:
    """Whether a string member's value has no escape."""
    return memchr(p + m.vstart + 1, CH_BACKSLASH, m.vend - m.vstart - 2) == NULL


cdef object _scalar(const unsigned char *p, const SseObject *o, int key, bint *ok):
    """A known member's value as ``obj.get(key)`` gives it, for null, plain strings and
    non-negative integers; ``ok`` cleared for anything else."""
    cdef const SseMember *m
    cdef int64_t v = 0
    cdef Py_ssize_t i
    if o.at[key] < 0:
        return None
    m = &o.m[o.at[key]]
    if m.kind == SSE_KIND_NULL:
        return None
    if m.kind == SSE_KIND_STRING and _plain(p, m):
        return PyUnicode_DecodeUTF8(<const char *>p + m.vstart + 1, m.vend - m.vstart - 2,
                                    NULL)
    if m.kind == SSE_KIND_NUMBER:
        for i in range(m.vstart, m.vend):
            if not (CH_0 <= p[i] <= CH_9):
                ok[0] = False
                return None
            v = v * 10 + (p[i] - CH_0)
        return v
    ok[0] = False
    return None


# -- shapes: the events that repeat the last one but for their text and token ids ---------
cdef bint _shape_object(SseShapeObject *d, const SseObject *o, Py_ssize_t base) noexcept nogil:
    """``o`` kept in ``d`` with offsets from ``base``; False when it has too many members
    (the slots' counts are set by :func:`_shape_slots` once the slots are known)."""
    cdef int j
    if o.n > SSE_SHAPE_MEMBERS:
        return False
    d.n = o.n
    memcpy(d.at, o.at, sizeof(d.at))
    for j in range(o.n):
        d.m[j].key = o.m[j].key - base
        d.m[j].vstart = o.m[j].vstart - base
        d.m[j].vend = o.m[j].vend - base
        d.m[j].kind = o.m[j].kind
    return True


cdef inline unsigned char _before(const SseShape *s, Py_ssize_t x) noexcept nogil:
    """How many slots end at or before offset ``x`` (which is never inside one)."""
    cdef unsigned char c = 0
    cdef int k
    for k in range(s.slots):
        if s.b[k] <= x:
            c += 1
    return c


cdef void _shape_slots(SseShape *s) noexcept nogil:
    cdef SseShapeObject *d
    cdef int j, l
    for l in range(3):
        d = &s.o[l]
        for j in range(d.n):
            d.m[j].nk = _before(s, d.m[j].key)
            d.m[j].nv = _before(s, d.m[j].vstart)
            d.m[j].ne = _before(s, d.m[j].vend)


cdef void _unshape_object(SseObject *o, const SseShapeObject *src,
                          const Py_ssize_t *moved) noexcept nogil:
    """``src`` as the SseObject of an event: ``moved[c]`` is where an offset after ``c``
    slots goes (the event's start plus the length the first ``c`` slots gained)."""
    cdef int j
    o.n = src.n
    memcpy(o.at, src.at, sizeof(src.at))
    for j in range(src.n):
        o.m[j].key = src.m[j].key + moved[src.m[j].nk]
        o.m[j].vstart = src.m[j].vstart + moved[src.m[j].nv]
        o.m[j].vend = src.m[j].vend + moved[src.m[j].ne]
        o.m[j].kind = src.m[j].kind


cdef list _id_list(const SseIds *b, Py_ssize_t a, Py_ssize_t e):
    cdef list out = []
    cdef Py_ssize_t k
    for k in range(a, e):
        out.append(b.v[k])
    return out


cdef class EventScanner:
    """The first leg of one recoverable stream, relayed on the bytes.

    ``EventScanner(chat, client_ids, shapes=True)``: ``chat`` for ``/v1/chat/completions``
    chunks (``delta``), else completion chunks (``text``); ``client_ids``: the client asked
    for ``return_token_ids`` itself (the token-id fields stay in what it sees); ``shapes``:
    an event scanned in full is kept as the *shape* of the next ones (an engine's chunks
    repeat each other but for the text and the token ids), and an event that has the
    shape's bytes around other valid values of those two is read from it (``_fit``: a
    compare, the new values scanned, the members moved) instead of scanned in full; same
    result, ~1.2k fewer instructions an event (``bench/kv_proxy_cost.py --stream``).
    After ``SSE_SHAPE_MISSES`` events in a row that do not fit, none is kept any more.

    :meth:`feed` takes one or more whole SSE events (each ended by a blank line, as
    ``relay_sse`` cuts them) and returns the bytes for the client, having appended the
    token ids to ``gen`` and updated the stream state; or ``None`` when any event of the
    block is not understood: then nothing was recorded and the caller runs the block
    through its JSON path, and copies that path's state back into the public flags.

    State (``StreamRecovery``'s words): ``role_sent``, ``ids_missing``, ``blocked``
    (reasoning or tool-call output seen), ``finished``, ``have_id`` (the response's
    ``id`` known), ``have_prompt`` (the prompt's token ids known), ``usage_sent``,
    ``done`` (``[DONE]`` passed). ``news``: the last :meth:`feed` changed one of them or
    captured something: ``resp_id`` / ``created`` / ``model`` of its last event read while
    ``have_id`` was false (``captured`` then true), ``prompt_ids`` (list of int, when
    ``have_prompt`` became true), ``finish_reason`` (its last non-null one; else None).
    Counters: ``events`` (data events passed), ``fallbacks`` (blocks returned ``None``),
    ``shaped`` (events read from the shape).
    """

    def __cinit__(self):
        self._shape = NULL
        self._ids.v = NULL
        self._ids.n = self._ids.cap = 0
        self._pids.v = NULL
        self._pids.n = self._pids.cap = 0
        self._out = NULL
        self._out_n = self._out_cap = 0

    def __init__(self, bint chat, bint client_ids, bint shapes=True):
        self.chat = chat
        self.client_ids = client_ids
        self._shapes = shapes

    def __dealloc__(self):
        self._free()

    cdef void _free(self) noexcept:
        PyMem_Free(self._shape)
        self._shape = NULL
        PyMem_Free(self._ids.v)
        self._ids.v = NULL
        self._ids.n = self._ids.cap = 0
        PyMem_Free(self._pids.v)
        self._pids.v = NULL
        self._pids.n = self._pids.cap = 0
        PyMem_Free(self._out)
        self._out = NULL
        self._out_n = self._out_cap = 0

    cdef int _emit(self, const char *p, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        cdef char *o
        if n <= 0:
            return 0
        if self._out_n + n > self._out_cap:
            cap = self._out_cap or 4096
            while cap < self._out_n + n:
                cap *= 2
            o = <char *>PyMem_Realloc(self._out, cap)
            if o == NULL:
                raise MemoryError()
            self._out = o
            self._out_cap = cap
        memcpy(self._out + self._out_n, p, n)
        self._out_n += n
        return 0

    cdef int _keep(self, const unsigned char *p, Py_ssize_t i, Py_ssize_t e,
                   const SseEvent *ev) except -1:
        """The event ``[i, e)``, scanned in full, kept as the shape of the next ones: its
        bytes, its members, and as slots its text (``delta.content`` or ``text``, when a
        string) and ``token_ids`` (when an array). Not kept (no shape): longer than
        ``SSE_SHAPE_BYTES``, an object with more than ``SSE_SHAPE_MEMBERS`` members, or
        prompt token ids in it (the first chunk's)."""
        cdef SseShape *s = self._shape
        cdef const SseMember *m
        cdef Py_ssize_t ta, tb
        if s == NULL:
            s = self._shape = <SseShape *>PyMem_Malloc(sizeof(SseShape))
            if s == NULL:
                raise MemoryError()
        s.n = 0
        if e - i > SSE_SHAPE_BYTES or ev.tp_a != ev.tp_b or ev.cp_a != ev.cp_b:
            return 0
        if not (_shape_object(&s.o[0], &ev.top, i) and _shape_object(&s.o[1], &ev.choice, i)
                and _shape_object(&s.o[2], &ev.delta, i)):
            return 0
        s.slots = 0
        m = NULL
        if self.chat:
            if ev.delta.at[SSE_KEY_CONTENT] >= 0:
                m = &ev.delta.m[ev.delta.at[SSE_KEY_CONTENT]]
        elif ev.choice.at[SSE_KEY_TEXT] >= 0:
            m = &ev.choice.m[ev.choice.at[SSE_KEY_TEXT]]
        if m != NULL and m.kind == SSE_KIND_STRING:
            s.a[0] = m.vstart - i
            s.b[0] = m.vend - i
            s.kind[0] = SSE_KIND_STRING
            s.slots = 1
        if ev.choice.at[SSE_KEY_TOKEN_IDS] >= 0:
            m = &ev.choice.m[ev.choice.at[SSE_KEY_TOKEN_IDS]]
            if m.kind == SSE_KIND_ARRAY:
                ta = m.vstart - i
                tb = m.vend - i
                if s.slots and ta < s.a[0]:        # the slots in offset order
                    s.a[1], s.b[1], s.kind[1] = s.a[0], s.b[0], s.kind[0]
                    s.a[0], s.b[0], s.kind[0] = ta, tb, SSE_KIND_ARRAY
                else:
                    s.a[s.slots], s.b[s.slots], s.kind[s.slots] = ta, tb, SSE_KIND_ARRAY
                s.slots += 1
        _shape_slots(s)
        s.choices = ev.choices
        memcpy(s.p, p + i, e - i)
        s.n = e - i
        return 0

    cdef int _fit(self, const unsigned char *p, Py_ssize_t i, Py_ssize_t e,
                  SseEvent *ev) except -1:
        """Whether the event ``[i, e)`` is the kept shape with other valid values in its
        slots (its other bytes the same): then ``ev`` is what a full scan gives (members
        moved by the slots' new lengths, the token ids appended to the buffer), and the
        event is valid JSON because the shape was. 0 with nothing recorded when not."""
        cdef const SseShape *s = self._shape
        cdef Py_ssize_t pos = i, t = 0, seg, end, n0 = self._ids.n
        cdef Py_ssize_t moved[SSE_SHAPE_SLOTS + 1]
        cdef bint esc = False
        cdef int k
        moved[0] = i
        for k in range(s.slots):
            seg = s.a[k] - t
            if pos + seg >= e or memcmp(p + pos, s.p + t, seg) != 0:
                self._ids.n = n0
                return 0
            pos += seg
            if s.kind[k] == SSE_KIND_STRING:
                end = json_string(p, pos, e, &esc) if p[pos] == CH_QUOTE else -1
            else:
                end = _ints(p, pos, e, &self._ids) if p[pos] == CH_LBRACKET else -1
            if end < 0:
                self._ids.n = n0
                return 0
            moved[k + 1] = moved[k] + (end - pos) - (s.b[k] - s.a[k])
            pos = end
            t = s.b[k]
        seg = s.n - t
        if pos + seg != e or memcmp(p + pos, s.p + t, seg) != 0:
            self._ids.n = n0
            return 0
        ev.choices = s.choices
        ev.tids_a = ev.tids_b = 0
        ev.tp_a = ev.tp_b = ev.cp_a = ev.cp_b = self._pids.n
        _unshape_object(&ev.top, &s.o[0], moved)
        _unshape_object(&ev.choice, &s.o[1], moved)
        _unshape_object(&ev.delta, &s.o[2], moved)
        return 1

    cdef int _decide(self, const unsigned char *p, SseEvent *ev, SseState *st,
                     SseCuts *cuts) except -2:
        """``StreamRecovery._event`` of the first leg on a scanned event: the stream state
        in ``st`` updated, the ranges to cut in ``cuts``; returns an ``SseAction``."""
        cdef SseObject *top = &ev.top
        cdef SseObject *ch = &ev.choice
        cdef SseObject *de = &ev.delta
        cdef unsigned long long top_cut = 0, ch_cut = 0, de_cut = 0
        cdef bint changed = False, ok = True, tids_none, text, fr_none
        cdef int k
        cdef const SseMember *m
        cdef object rid
        if top.at[SSE_KEY_ERROR] >= 0:
            return SSE_UNSURE                       # an engine's error event
        if not st.have_id:
            rid = _scalar(p, top, SSE_KEY_ID, &ok)
            self._created = _scalar(p, top, SSE_KEY_CREATED, &ok)
            self._model = _scalar(p, top, SSE_KEY_MODEL, &ok)
            if not ok:
                return SSE_UNSURE
            self._resp_id = rid
            self._captured = True
            st.have_id = rid is not None
        # the chat's prompt ids (vLLM's first chunk), cut unless the client asked for them
        if self.chat and top.at[SSE_KEY_PROMPT_TOKEN_IDS] >= 0:
            k = _kind_of(top, SSE_KEY_PROMPT_TOKEN_IDS)
            if k == SSE_KIND_ARRAY:
                if not st.have_prompt:
                    st.have_prompt = True
                    self._prompt_a = ev.tp_a
                    self._prompt_b = ev.tp_b
                if not self.client_ids or st.role_sent:
                    top_cut |= _bit(top, SSE_KEY_PROMPT_TOKEN_IDS) | _bit(top, SSE_KEY_PROMPT_TEXT)
                    changed = True
            elif k != SSE_KIND_NULL:
                return SSE_UNSURE
        if ev.choices != SSE_CHOICES_ONE:
            k = _kind_of(top, SSE_KEY_CHOICES)
            if k != 0 and k != SSE_KIND_NULL and ev.choices != SSE_CHOICES_EMPTY:
                return SSE_UNSURE
            k = _kind_of(top, SSE_KEY_USAGE)
            if k != 0 and k != SSE_KIND_NULL:
                st.usage_sent = True
            if _cuts(top, top_cut, cuts) < 0:
                return SSE_UNSURE
            return SSE_CUT if changed else SSE_PASS
        # choices[0]: generated token ids
        k = _kind_of(ch, SSE_KEY_TOKEN_IDS)
        if k != 0 and k != SSE_KIND_NULL and k != SSE_KIND_ARRAY:
            return SSE_UNSURE
        tids_none = k != SSE_KIND_ARRAY
        if k != 0 and not self.client_ids:
            ch_cut |= _bit(ch, SSE_KEY_TOKEN_IDS)
            changed = True
        k = _kind_of(ch, SSE_KEY_FINISH_REASON)
        if k != 0 and k != SSE_KIND_NULL and not (
                k == SSE_KIND_STRING and _plain(p, &ch.m[ch.at[SSE_KEY_FINISH_REASON]])):
            return SSE_UNSURE
        fr_none = k == 0 or k == SSE_KIND_NULL
        if _kind_of(ch, SSE_KEY_STOP_REASON) == SSE_KIND_STRING:
            m = &ch.m[ch.at[SSE_KEY_STOP_REASON]]
            if not _plain(p, m) or (m.vend - m.vstart == 12
                                    and memcmp(p + m.vstart, b'"recomputed"', 12) == 0):
                return SSE_UNSURE                   # preempted: the JSON path rewrites it
        if not self.chat:
            k = _kind_of(ch, SSE_KEY_TEXT)
            if k != 0 and k != SSE_KIND_NULL and k != SSE_KIND_STRING:
                return SSE_UNSURE
            text = k == SSE_KIND_STRING and ch.m[ch.at[SSE_KEY_TEXT]].vend \
                - ch.m[ch.at[SSE_KEY_TEXT]].vstart > 2
            k = _kind_of(ch, SSE_KEY_PROMPT_TOKEN_IDS)
            if k == SSE_KIND_ARRAY:
                if not st.have_prompt:
                    st.have_prompt = True
                    self._prompt_a = ev.cp_a
                    self._prompt_b = ev.cp_b
                if not self.client_ids:
                    ch_cut |= _bit(ch, SSE_KEY_PROMPT_TOKEN_IDS) | _bit(ch, SSE_KEY_PROMPT_TEXT)
                elif _kind_of(ch, SSE_KEY_PROMPT_TEXT) == SSE_KIND_NULL:
                    ch_cut |= _bit(ch, SSE_KEY_PROMPT_TEXT)
                changed = True
            elif k == SSE_KIND_NULL:
                if changed:      # popped by the JSON path, so gone when it re-encodes
                    ch_cut |= _bit(ch, SSE_KEY_PROMPT_TOKEN_IDS)
            elif k != 0:
                return SSE_UNSURE
        else:
            k = _kind_of(ch, SSE_KEY_DELTA)
            if k != 0 and k != SSE_KIND_NULL and k != SSE_KIND_OBJECT:
                return SSE_UNSURE
            if k != SSE_KIND_OBJECT:
                _reset(de)
            k = _kind_of(de, SSE_KEY_CONTENT)
            if k != 0 and k != SSE_KIND_NULL and k != SSE_KIND_STRING:
                return SSE_UNSURE
            text = k == SSE_KIND_STRING and de.m[de.at[SSE_KEY_CONTENT]].vend \
                - de.m[de.at[SSE_KEY_CONTENT]].vstart > 2
            if de.at[SSE_KEY_ROLE] >= 0:
                if st.role_sent:
                    if not text and fr_none and tids_none:
                        return SSE_DROP             # a restarted leg's role chunk
                    de_cut |= _bit(de, SSE_KEY_ROLE)
                    changed = True
                st.role_sent = True
            if de.at[SSE_KEY_REASONING] >= 0:
                st.blocked = True
        if tids_none and text:
            st.ids_missing = True
        if not fr_none:
            st.finished = True
            m = &ch.m[ch.at[SSE_KEY_FINISH_REASON]]
            self._finish_reason = PyUnicode_DecodeUTF8(<const char *>p + m.vstart + 1,
                                                       m.vend - m.vstart - 2, NULL)
        if (_cuts(top, top_cut, cuts) < 0 or _cuts(ch, ch_cut, cuts) < 0
                or _cuts(de, de_cut, cuts) < 0):
            return SSE_UNSURE
        return SSE_CUT if changed else SSE_PASS

    def feed(self, bytes block not None, list gen not None):
        """The client's bytes for ``block`` (whole SSE events), or ``None``.

        Parameters
        ----------
        block : bytes
            One or more SSE events, each ended by a blank line (a last one without it is
            taken as ended).
        gen : list of int
            The stream's generated token ids; this block's are appended (only when the
            result is not ``None``).

        Returns
        -------
        bytes or None
            ``block`` itself when nothing in it changes; the events with the token-id
            fields cut (``data:`` events), dropped events left out, each ended by a blank
            line; ``None`` when an event is not understood (nothing recorded).
        """
        return self._feed(block, gen)

    cdef object _feed(self, bytes block, list gen):
        """:meth:`feed` for compiled callers (``motor._fast.relay``): ``block`` and ``gen``
        not None."""
        cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(block)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(block)
        cdef Py_ssize_t i = 0, e, a, j, pa, pe, k
        cdef const unsigned char *nl
        cdef SseState st
        cdef SseEvent ev
        cdef SseCuts cuts
        cdef int act, c
        cdef bint same = True, fit
        cdef int64_t events = 0
        st.role_sent = self.role_sent
        st.ids_missing = self.ids_missing
        st.blocked = self.blocked
        st.finished = self.finished
        st.have_id = self.have_id
        st.have_prompt = self.have_prompt
        st.usage_sent = self.usage_sent
        st.done = self.done
        self._ids.n = 0
        self._pids.n = 0
        self._out_n = 0
        self._resp_id = self._created = self._model = self._finish_reason = None
        self._prompt_a = self._prompt_b = -1
        self._captured = False
        self.news = self.captured = False
        self.finish_reason = self.prompt_ids = None
        while i < n:
            # the event [i, e), ended by "\n\n" at e (or the end of the block). Nothing is
            # copied while every event passes as it came (``same``): the first one that
            # does not copies the block up to it at once, then each event its own way
            nl = <const unsigned char *>memchr(p + i, CH_LF, n - i)
            if nl == NULL:
                e = n
                if same:                            # the JSON path adds the blank line
                    same = False
                    self._emit(<const char *>p, i)
            else:
                e = nl - p
                if e + 1 >= n or p[e + 1] != CH_LF:
                    self.fallbacks += 1             # a line break inside an event
                    return None
            if e == i:                              # an empty event: skipped
                if same:
                    same = False
                    self._emit(<const char *>p, i)
                i = e + 2
                continue
            cuts.n = 0
            if e - i < 5 or memcmp(p + i, b"data:", 5) != 0:
                act = SSE_PASS                      # a comment or another field
            else:
                pa = json_ws(p, i + 5, e)
                if pa < e and p[pa] == CH_LBRACKET:
                    if not (pa + 6 <= e and memcmp(p + pa, b"[DONE]", 6) == 0
                            and json_ws(p, pa + 6, e) == e and st.finished):
                        self.fallbacks += 1         # [DONE] before the finish (or not it)
                        return None
                    st.done = True
                    act = SSE_PASS
                else:
                    if pa >= e or p[pa] != CH_LBRACE:
                        self.fallbacks += 1
                        return None
                    k = self._pids.n
                    if self._shape != NULL and self._shape.n and self._fit(p, i, e, &ev):
                        fit = True
                        self.shaped += 1
                        self._misses = 0
                    else:
                        fit = False
                        ev.choices = SSE_CHOICES_ABSENT
                        ev.tids_a = ev.tids_b = ev.tp_a = ev.tp_b = ev.cp_a = ev.cp_b = 0
                        _reset(&ev.choice)
                        _reset(&ev.delta)
                        pe = _object(p, pa, e, &ev.top, SSE_LEVEL_TOP, &ev, &self._ids,
                                     &self._pids)
                        if pe < 0 or json_ws(p, pe, e) != e:
                            self.fallbacks += 1
                            return None
                    act = self._decide(p, &ev, &st, &cuts)
                    if act == SSE_UNSURE:
                        self.fallbacks += 1
                        return None
                    if not fit and self._shapes:
                        # the events after it may repeat it; after SSE_SHAPE_MISSES in a
                        # row that do not, the stream's events differ in more than their
                        # text and ids (log probabilities...): no more shapes kept
                        if self._misses < SSE_SHAPE_MISSES:
                            self._misses += 1
                            self._keep(p, i, e, &ev)
                        elif self._shape != NULL:
                            self._shape.n = 0
                    if self._prompt_a < k:
                        self._pids.n = k            # prompt ids not kept: space reused
                    if act != SSE_DROP:
                        events += 1
            if act != SSE_PASS and same:
                same = False
                self._emit(<const char *>p, i)
            if act == SSE_DROP:
                pass
            elif act == SSE_CUT:
                # cuts in offset order (they never overlap)
                for j in range(1, cuts.n):
                    a = cuts.a[j]
                    k = cuts.b[j]
                    c = j - 1
                    while c >= 0 and cuts.a[c] > a:
                        cuts.a[c + 1] = cuts.a[c]
                        cuts.b[c + 1] = cuts.b[c]
                        c -= 1
                    cuts.a[c + 1] = a
                    cuts.b[c + 1] = k
                a = i
                for j in range(cuts.n):
                    self._emit(<const char *>p + a, cuts.a[j] - a)
                    a = cuts.b[j]
                self._emit(<const char *>p + a, e - a)
                self._emit(b"\n\n", 2)
            elif not same:
                self._emit(<const char *>p + i, e - i)
                self._emit(b"\n\n", 2)
            i = e + 2
        # the whole block is understood: keep what it said
        for k in range(self._ids.n):
            gen.append(self._ids.v[k])
        self.events += events
        if (st.role_sent != self.role_sent or st.ids_missing != self.ids_missing
                or st.blocked != self.blocked or st.finished != self.finished
                or st.have_prompt != self.have_prompt or st.usage_sent != self.usage_sent
                or st.done != self.done or self._captured or self._finish_reason is not None):
            self.news = True
            self.role_sent = st.role_sent
            self.ids_missing = st.ids_missing
            self.blocked = st.blocked
            self.finished = st.finished
            self.usage_sent = st.usage_sent
            self.done = st.done
            if self._captured:
                self.captured = True
                self.have_id = st.have_id
                self.resp_id = self._resp_id
                self.created = self._created
                self.model = self._model
            if self._finish_reason is not None:
                self.finish_reason = self._finish_reason
            if st.have_prompt and not self.have_prompt:
                self.have_prompt = True
                self.prompt_ids = _id_list(&self._pids, self._prompt_a, self._prompt_b)
        if same:
            return block
        return PyBytes_FromStringAndSize(self._out, self._out_n)

    def sync(self, *, bint role_sent, bint ids_missing, bint blocked, bint finished,
             bint have_id, bint have_prompt, bint usage_sent, bint done):
        """Set the stream state after the caller's JSON path handled a block."""
        self.role_sent = role_sent
        self.ids_missing = ids_missing
        self.blocked = blocked
        self.finished = finished
        self.have_id = have_id
        self.have_prompt = have_prompt
        self.usage_sent = usage_sent
        self.done = done
