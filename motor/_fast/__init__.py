"""Compiled hot path of motor (Cython). This package only re-exports.

See ``docs/fast.md`` for the algorithms, complexity and memory figures.
"""
from motor._fast.hashing import HASH_ZERO_REMAP, block_hashes, block_hashes_into, hash_block

__all__ = [
    "HASH_ZERO_REMAP",
    "block_hashes",
    "block_hashes_into",
    "hash_block",
]
