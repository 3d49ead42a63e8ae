# cython: language_level=3
"""C-level API of ``motor._fast.sse`` (see sse.pyx)."""
from libc.stdint cimport int64_t

cdef enum:
    SSE_MAX_MEMBERS = 48     # members of one scanned object; more: the JSON path
    SSE_MAX_CUTS = 8         # byte ranges cut out of one event
    SSE_SHAPE_BYTES = 1024   # an event kept as the next events' shape: at most this long
    SSE_SHAPE_MEMBERS = 16   # ... and with at most this many members in each of its objects
    SSE_SHAPE_SLOTS = 2      # values that may differ from it: the text and the token ids
    SSE_SHAPE_MISSES = 4     # events in a row that do not fit the shape: no more shapes


cdef enum SseLevel:          # which object a member belongs to
    SSE_LEVEL_TOP = 0        # the event
    SSE_LEVEL_CHOICE = 1     # choices[0]
    SSE_LEVEL_DELTA = 2      # choices[0].delta


cdef enum:                   # SseKey: the members the relay looks at (SSE_KEY_OTHER: any other)
    SSE_KEY_OTHER = 0
    SSE_KEY_ID = 1
    SSE_KEY_CREATED = 2
    SSE_KEY_MODEL = 3
    SSE_KEY_CHOICES = 4
    SSE_KEY_USAGE = 5
    SSE_KEY_PROMPT_TOKEN_IDS = 6
    SSE_KEY_PROMPT_TEXT = 7
    SSE_KEY_ERROR = 8
    SSE_KEY_TOKEN_IDS = 9
    SSE_KEY_TEXT = 10
    SSE_KEY_DELTA = 11
    SSE_KEY_FINISH_REASON = 12
    SSE_KEY_STOP_REASON = 13
    SSE_KEY_ROLE = 14
    SSE_KEY_CONTENT = 15
    SSE_KEY_REASONING = 16   # reasoning_content, reasoning or tool_calls
    SSE_N_KEYS = 17


cdef enum SseKind:           # a member value's JSON type (first byte)
    SSE_KIND_NULL = 1
    SSE_KIND_STRING = 2
    SSE_KIND_NUMBER = 3
    SSE_KIND_BOOL = 4
    SSE_KIND_ARRAY = 5
    SSE_KIND_OBJECT = 6


cdef enum SseChoices:        # the event's "choices"
    SSE_CHOICES_ABSENT = 0   # absent or null
    SSE_CHOICES_EMPTY = 1    # []
    SSE_CHOICES_ONE = 2      # [ {...} ]


cdef enum SseAction:         # what one event becomes
    SSE_UNSURE = -1          # not understood: the whole block takes the JSON path
    SSE_PASS = 0             # its bytes as they came
    SSE_CUT = 1              # its bytes less the cut ranges
    SSE_DROP = 2             # nothing


cdef struct SseMember:
    Py_ssize_t key           # offset of the key's opening quote
    Py_ssize_t vstart        # offset of the value's first byte
    Py_ssize_t vend          # offset after the value
    int kind                 # SseKind


cdef struct SseObject:
    SseMember m[SSE_MAX_MEMBERS]
    int n
    int at[SSE_N_KEYS]       # member index of each known key, -1 when absent


cdef struct SseIds:          # growable int64 buffer (PyMem)
    int64_t *v
    Py_ssize_t n
    Py_ssize_t cap


cdef struct SseEvent:        # one scanned ``data:`` event
    SseObject top
    SseObject choice
    SseObject delta
    int choices              # SseChoices
    Py_ssize_t tids_a, tids_b    # choices[0].token_ids in the token-id buffer
    Py_ssize_t tp_a, tp_b        # top-level prompt_token_ids in the prompt buffer
    Py_ssize_t cp_a, cp_b        # choices[0].prompt_token_ids in the prompt buffer


cdef struct SseState:        # the stream's state the decisions read and write
    bint role_sent
    bint ids_missing
    bint blocked
    bint finished
    bint have_id
    bint have_prompt
    bint usage_sent
    bint done


cdef struct SseCuts:
    Py_ssize_t a[SSE_MAX_CUTS]
    Py_ssize_t b[SSE_MAX_CUTS]
    int n


cdef struct SseShapeMember:  # an SseMember of a kept shape: offsets from the event's start,
    Py_ssize_t key           # and for each the number of slots that end at or before it
    Py_ssize_t vstart        # (what moves it in an event whose slots changed length)
    Py_ssize_t vend
    int kind
    unsigned char nk, nv, ne


cdef struct SseShapeObject:  # an SseObject of a kept shape
    SseShapeMember m[SSE_SHAPE_MEMBERS]
    int n
    int at[SSE_N_KEYS]


cdef struct SseShape:        # the last event scanned in full, for the events that repeat it
    unsigned char p[SSE_SHAPE_BYTES]     # its bytes, "data:" to the end (no blank line)
    Py_ssize_t n
    int slots                            # values that may differ, in offset order:
    Py_ssize_t a[SSE_SHAPE_SLOTS]        # their spans [a, b) in p
    Py_ssize_t b[SSE_SHAPE_SLOTS]
    int kind[SSE_SHAPE_SLOTS]            # SSE_KIND_STRING or SSE_KIND_ARRAY (token ids)
    int choices                          # SseChoices
    SseShapeObject o[3]                  # top, choices[0], delta


cdef class EventScanner:
    cdef readonly bint chat
    cdef readonly bint client_ids
    cdef public bint role_sent
    cdef public bint ids_missing
    cdef public bint blocked
    cdef public bint finished
    cdef public bint have_id
    cdef public bint have_prompt
    cdef public bint usage_sent
    cdef public bint done
    cdef readonly object resp_id
    cdef readonly object created
    cdef readonly object model
    cdef readonly object finish_reason
    cdef readonly object prompt_ids
    cdef readonly bint news
    cdef readonly bint captured
    cdef readonly int64_t events
    cdef readonly int64_t fallbacks
    cdef readonly int64_t shaped
    cdef bint _shapes
    cdef int _misses
    cdef SseShape *_shape
    cdef SseIds _ids
    cdef SseIds _pids
    cdef char *_out
    cdef Py_ssize_t _out_n
    cdef Py_ssize_t _out_cap
    # captures of the block being scanned, kept only if the whole block is understood
    cdef object _resp_id
    cdef object _created
    cdef object _model
    cdef object _finish_reason
    cdef Py_ssize_t _prompt_a
    cdef Py_ssize_t _prompt_b
    cdef bint _captured

    cdef void _free(self) noexcept
    cdef int _emit(self, const char *p, Py_ssize_t n) except -1
    cdef int _decide(self, const unsigned char *p, SseEvent *ev, SseState *st,
                     SseCuts *cuts) except -2
    cdef object _feed(self, bytes block, list gen)
    cdef int _keep(self, const unsigned char *p, Py_ssize_t i, Py_ssize_t e,
                   const SseEvent *ev) except -1
    cdef int _fit(self, const unsigned char *p, Py_ssize_t i, Py_ssize_t e,
                  SseEvent *ev) except -1
