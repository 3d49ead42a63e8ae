"""Engine KV events -> prefix-index operations, for one index (no sockets here).

:class:`KvIngest` is a plain class so that it can run wherever the events arrive:
today in the coordinator's worker (:mod:`motor.coordinator.kv.subscriber` feeds it),
later in the feed process that writes the shared-memory rings.

Per instance slot it keeps:

* ``maps[tier]``: engine block hash -> motor block hash (or a tuple of them when the
  engine's block is a multiple of motor's block size). ``BlockStored`` carries token
  ids; motor re-hashes them with :func:`motor._fast.hashing.block_hashes`, chained
  to the motor hash of the engine's ``parent_block_hash``, so motor never depends on
  the engine's hash algorithm or seed. ``BlockRemoved`` only carries engine hashes:
  the map translates them.
* ``last_seq``: the publisher's last sequence number, for :meth:`KvIngest.check_seq`.

Memory per held block: the radix node (``PrefixIndex.memory_bytes / n_nodes``, about
60-100 bytes) plus one dict entry with two Python ints (about 110 bytes); see
:meth:`KvIngest.memory_bytes` and docs/kv-routing.md.
"""
from __future__ import annotations

import logging
from enum import IntEnum
from collections.abc import Callable, Hashable

import numpy as np

from motor._fast.hashing import block_hashes
from motor._fast.radix import PrefixIndex
from motor.protocol.kv_events import (
    TIER_DISK, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, adapter_salt,
    tier_of_medium)

logger = logging.getLogger(__name__)

#: Estimated bytes of one engine-hash -> motor-hash entry (dict slot + two ints).
MAP_ENTRY_BYTES = 112


class SeqCheck(IntEnum):
    """What a batch's sequence number means for the slot's event stream."""
    OK = 0          #: the next one (or the first one seen)
    GAP = 1         #: batches were lost between ``last_seq`` and this one
    RESTART = 2     #: the publisher restarted (seq 0 again): its cache is new
    DUPLICATE = 3   #: already applied (replay overlap): skip


class SlotState:
    """What :class:`KvIngest` knows of one instance slot."""

    __slots__ = ("slot", "name", "maps", "last_seq", "applied", "dropped")

    def __init__(self, slot: int, name: str) -> None:
        self.slot = slot
        self.name = name
        self.maps: list[dict[Hashable, int | tuple[int, ...]]] = [{}, {}, {}]
        self.last_seq = -1
        self.applied = 0
        self.dropped = 0

    def map_entries(self) -> int:
        return sum(len(m) for m in self.maps)


class KvIngest:
    """Apply decoded event batches of many instance slots to one :class:`PrefixIndex`.

    Parameters
    ----------
    index : PrefixIndex
        The exact index (event-driven).
    block_size : int
        motor's block size in tokens (the query side hashes with the same size). An
        engine block size that is a multiple of it is split; any other is dropped.
    on_drop : callable(reason: str, n: int), optional
        Called for events (or blocks) that could not be applied, with a reason
        (``orphan``, ``block_size``, ``medium``, ``unknown_type``).
    on_apply : callable(kind: str, n: int), optional
        Called for applied events by kind (``stored``, ``removed``, ``cleared``).
    """

    def __init__(self, index: PrefixIndex, block_size: int,
                 on_drop: Callable[[str, int], object] | None = None,
                 on_apply: Callable[[str, int], object] | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size is expected to be > 0, got {block_size}")
        self.index = index
        self.block_size = block_size
        self.slots: dict[int, SlotState] = {}
        self._on_drop = on_drop
        self._on_apply = on_apply
        self._warned: set[str] = set()

    # -- slots ------------------------------------------------------------------
    def add_slot(self, slot: int, name: str) -> SlotState:
        st = self.slots.get(slot)
        if st is None:
            st = self.slots[slot] = SlotState(slot, name)
        return st

    def purge(self, slot: int) -> int:
        """Forget everything of ``slot`` (index holdings and hash maps); keeps the slot.
        Returns the holdings removed."""
        st = self.slots.get(slot)
        if st is not None:
            st.maps = [{}, {}, {}]
        return self.index.clear(slot)

    def drop_slot(self, slot: int) -> int:
        """The instance left: purge it and forget the slot."""
        n = self.purge(slot)
        self.slots.pop(slot, None)
        return n

    # -- sequence numbers -------------------------------------------------------------
    def check_seq(self, slot: int, seq: int) -> SeqCheck:
        """Classify ``seq`` against the slot's last one (does not record it)."""
        last = self.slots[slot].last_seq
        if last < 0 or seq == last + 1:
            return SeqCheck.OK
        if seq > last + 1:
            return SeqCheck.GAP
        if seq == 0:
            return SeqCheck.RESTART
        return SeqCheck.DUPLICATE

    # -- events -----------------------------------------------------------------
    def _drop(self, st: SlotState, reason: str, n: int = 1) -> None:
        st.dropped += n
        if self._on_drop is not None:
            self._on_drop(reason, n)

    def apply(self, slot: int, seq: int, batch: EventBatch, now: float = 0.0) -> int:
        """Apply one batch of ``slot`` and record ``seq``; returns the events applied."""
        st = self.slots[slot]
        st.last_seq = seq
        applied = 0
        for ev in batch.events:
            if type(ev) is BlockStored:
                applied += self._stored(st, ev, now)
            elif type(ev) is BlockRemoved:
                applied += self._removed(st, ev)
            elif type(ev) is AllBlocksCleared:
                self.purge(slot)
                applied += 1
                if self._on_apply is not None:
                    self._on_apply("cleared", 1)
            else:
                self._drop(st, "unknown_type")
        st.applied += applied
        return applied

    def _tier(self, st: SlotState, medium: str | None) -> int:
        tier = tier_of_medium(medium)
        if tier is None:
            if medium not in self._warned:
                self._warned.add(str(medium))
                logger.warning("KV events of %s: unknown medium %r, counted as disk tier",
                               st.name, medium)
            tier = TIER_DISK
        return tier

    def _parent(self, st: SlotState, parent: Hashable | None) -> int | None:
        if parent is None:
            return 0
        for m in st.maps:
            v = m.get(parent)
            if v is not None:
                return v if type(v) is int else v[-1]  # type: ignore[index]
        return None

    def _stored(self, st: SlotState, ev: BlockStored, now: float) -> int:
        n = len(ev.block_hashes)
        if n == 0:
            return 0
        bs = self.block_size
        if ev.block_size % bs:
            if "block_size" not in self._warned:
                self._warned.add("block_size")
                logger.warning("KV events of %s: engine block_size %d is not a multiple of "
                               "coordinator.kv.block_size %d; its blocks are ignored",
                               st.name, ev.block_size, bs)
            self._drop(st, "block_size", 1)
            return 0
        parent = self._parent(st, ev.parent_block_hash)
        if parent is None:
            # the parent's store was lost (or evicted before we saw it): no chain to hash on
            self._drop(st, "orphan", 1)
            return 0
        tier = self._tier(st, ev.medium)
        # blocks computed under a LoRA adapter hash apart from the base model's (case N12);
        # an adapter known only by its id (older vLLM) matches no request: never credited
        lora = ev.lora_name or (f"lora-id:{ev.lora_id}" if ev.lora_id else None)
        mh = block_hashes(np.asarray(ev.token_ids, dtype=np.uint32), bs, parent,
                          adapter_salt(lora))
        m = st.maps[tier]
        k = ev.block_size // bs
        if k == 1:
            m.update(zip(ev.block_hashes, mh.tolist()))
        else:
            hl = mh.tolist()
            for j, e in enumerate(ev.block_hashes):
                m[e] = tuple(hl[j * k:(j + 1) * k])
        self.index.store(st.slot, tier, parent, mh, now)
        if self._on_apply is not None:
            self._on_apply("stored", 1)
        return 1

    def _removed(self, st: SlotState, ev: BlockRemoved) -> int:
        tier = self._tier(st, ev.medium)
        m = st.maps[tier]
        out: list[int] = []
        for e in ev.block_hashes:
            v = m.pop(e, None)
            if v is None:
                continue
            if type(v) is int:
                out.append(v)
            else:
                out.extend(v)  # type: ignore[arg-type]
        if out:
            self.index.remove(st.slot, tier, np.asarray(out, dtype=np.uint64))
        if self._on_apply is not None:
            self._on_apply("removed", 1)
        return 1

    # -- size ---------------------------------------------------------------------
    def map_entries(self) -> int:
        return sum(st.map_entries() for st in self.slots.values())

    def memory_bytes(self) -> int:
        """Estimated bytes of the hash maps (the index reports its own)."""
        return MAP_ENTRY_BYTES * self.map_entries()


__all__ = ["KvIngest", "SeqCheck", "SlotState", "MAP_ENTRY_BYTES"]
