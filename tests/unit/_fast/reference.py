"""Pure-Python reference models of ``motor._fast`` (hashing, radix, scoring, ring).

Written straight from the docstrings / ``docs/fast.md``, for clarity not speed.
The compiled modules must agree with these on every input.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1

# ---------------------------------------------------------------- hashing

_M = (0x6CC6BE1805FDF179, 0x4BA71AB7AC0504A5, 0xDAE85D0928398F9F, 0x0B8E90E9F6466D5F)
_S = (0xC4E08E67B822B63B, 0x28B58AB4D47A9A79, 0x25318BF27B885975, 0x3D3DB70B0D99ED21)
_MC = 0x87A152F460CA36FF
_MP = 0x167DD69A83F614DD
_ME = 0xFDA536A3A434D6F9
_MLEN = 0x9D4615766CD44F91
HASH_ZERO_REMAP = 0x2545F4914F6CDD1D


def _xs32(x: int) -> int:
    return x ^ (x >> 32)


def mix13(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def content_hash(tokens: list[int], extra: int = 0) -> int:
    """Content hash of one block (before the parent is folded in)."""
    e = (extra * _ME) & MASK64
    lanes = [s ^ e for s in _S]
    words = [tokens[i] | (tokens[i + 1] << 32) for i in range(0, len(tokens) - 1, 2)]
    if len(tokens) % 2:
        words.append(tokens[-1])
    for j, w in enumerate(words):
        lane = j % 4
        lanes[lane] = _xs32(((lanes[lane] ^ w) * _M[lane]) & MASK64)
    c = (len(tokens) * _MLEN) & MASK64
    for a in lanes:
        c = _xs32(((c ^ a) * _MC) & MASK64)
    return c


def hash_block(parent: int, tokens: list[int], extra: int = 0) -> int:
    if not tokens:
        raise ValueError("tokens is expected to hold one block (>= 1 token), got 0")
    h = mix13(content_hash(list(tokens), extra) ^ ((parent * _MP) & MASK64))
    return h if h else HASH_ZERO_REMAP


def block_hashes(tokens, block_size: int, parent: int = 0, extra: int = 0) -> list[int]:
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    tokens = [int(t) for t in tokens]
    out = []
    h = parent
    for k in range(len(tokens) // block_size):
        h = hash_block(h, tokens[k * block_size:(k + 1) * block_size], extra)
        out.append(h)
    return out
