"""Compiled hot path of motor (Cython). This package only re-exports.

See ``docs/fast.md`` for the algorithms, complexity and memory figures.
"""
from motor._fast.hashing import HASH_ZERO_REMAP, block_hashes, block_hashes_into, hash_block
from motor._fast.radix import N_TIERS, TIER_DEVICE, TIER_DISK, TIER_HOST, PrefixIndex
from motor._fast.ring import RECORD_OVERFLOW, RECORD_USER, Ring
from motor._fast.scoring import costs, pick
from motor._fast.sse import EventScanner

__all__ = [
    "EventScanner",
    "HASH_ZERO_REMAP",
    "N_TIERS",
    "PrefixIndex",
    "RECORD_OVERFLOW",
    "RECORD_USER",
    "Ring",
    "TIER_DEVICE",
    "TIER_DISK",
    "TIER_HOST",
    "block_hashes",
    "block_hashes_into",
    "costs",
    "hash_block",
    "pick",
]
