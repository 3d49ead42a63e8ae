"""Paged KV cache of the simulator: fixed-size blocks, prefix caching, LRU eviction.

A sequence holds a list of block ids (its block table). A block that is full and
whose tokens have been computed gets a *block hash* (chained: it folds in the hash
of the block before it) and is entered in the prefix cache. When the last sequence
using a block lets go of it, the block goes to the free queue but keeps its hash,
so a later prompt with the same prefix can take it back (a cache hit) until it is
evicted: allocation takes free blocks least-recently-freed first, dropping their
hash. Blocks that never got a hash are handed out before cached ones.

Block hashes here are motor's simple Python chain ``hash((parent, tuple(tokens)))``
reduced to 64 bits (deterministic across processes: ints and tuples of ints are not
salted by ``PYTHONHASHSEED``). The first block's parent is :data:`ROOT_PARENT`, or for a
request under a LoRA adapter :func:`lora_root` of its name: an adapter's blocks never
share a hash with the base model's or another adapter's (vLLM puts the LoRA name in its
block hashes' extra keys), and their ``BlockStored`` events name the adapter
(``lora_name``).

When ``record_events`` is on, the pool keeps the KV events of the current step
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` as plain tuples) for the
engine to publish; see :meth:`BlockPool.take_events`.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

MASK64 = (1 << 64) - 1
#: parent hash used for a sequence's first block
ROOT_PARENT = 0


def lora_root(lora_name: str | None) -> int:
    """The first block's parent of a sequence computed under ``lora_name`` (:data:`ROOT_PARENT`
    for the base model): a stable 64-bit value of the name (BLAKE2b), never 0."""
    if not lora_name:
        return ROOT_PARENT
    v = int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8,
                                       person=b"motor-sim-lora").digest(), "little")
    return v or 1


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block of ``tokens`` whose previous block hashed to ``parent``."""
    return hash((parent, tuple(tokens))) & MASK64


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_PARENT) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a partial last block has none)."""
    out = []
    h = parent
    for k in range(len(tokens) // block_size):
        h = hash_block(h, tokens[k * block_size:(k + 1) * block_size])
        out.append(h)
    return out


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens with a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # free blocks, eviction order first (hashless ones are moved to the front)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # events of the current step: ("stored", [hashes], parent, [token ids]) with a fifth
        # item lora_name for an adapter's blocks / ("removed", [hashes]) / ("cleared",)
        self.events: list[tuple] = []

    # -- queries --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some sequence (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (not yet referenced)."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        cached = self.cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    # -- reference counting -------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit ``blocks`` (removes them from the free queue)."""
        ref, free = self.ref, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting cached free blocks LRU-first), or None if too few."""
        if n > len(self.free):
            return None
        out = []
        removed: list[int] = []
        free, ref, block_hash, cached = self.free, self.ref, self.block_hash, self.cached
        for _ in range(n):
            b, _none = free.popitem(last=False)
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    removed.append(h)
            ref[b] = 1
            out.append(b)
        if removed and self.record_events:
            self.events.append(("removed", removed))
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of ``blocks``; unreferenced ones become free.

        Released in reverse order so a sequence's tail blocks are evicted before its
        head blocks (those are the ones other prompts are likeliest to share).
        """
        ref, free, block_hash = self.ref, self.free, self.block_hash
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
                if block_hash[b] is None:
                    free.move_to_end(b, last=False)

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None,
                     tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Enter full, computed ``blocks`` with their ``hashes`` into the prefix cache.

        ``parent`` is the hash of the block before the first one (None for a
        sequence's first block), ``tokens`` the token ids of all of them and ``lora_name``
        the adapter they were computed under (None: the base model), for the
        ``BlockStored`` event.
        """
        if not self.enable_prefix_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        stored: list[int] = []
        for b, h in zip(blocks, hashes):
            if block_hash[b] is not None:
                continue
            if h in cached:  # same content computed twice at once: keep the first copy
                continue
            block_hash[b] = h
            cached[h] = b
            stored.append(h)
        if stored and self.record_events:
            if len(stored) == len(blocks):
                self.events.append(("stored", stored, parent, list(tokens))
                                   + ((lora_name,) if lora_name else ()))
            else:  # rare: some were duplicates; report those we stored one by one
                bs = self.block_size
                prev = parent
                for i, (b, h) in enumerate(zip(blocks, hashes)):
                    if block_hash[b] == h and cached.get(h) == b and h in stored:
                        self.events.append(("stored", [h], prev, list(tokens[i * bs:(i + 1) * bs]))
                                           + ((lora_name,) if lora_name else ()))
                    prev = h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash of free blocks (False if some blocks are still in use)."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.record_events:
            self.events.append(("cleared",))
        return True

    def take_events(self) -> list[tuple]:
        ev, self.events = self.events, []
        return ev
