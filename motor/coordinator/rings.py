"""What the feed and the workers of a multi-worker coordinator say over their rings, and
each worker's end of them (:class:`WorkerLink`).

Every worker ``i`` has two SPSC rings (:mod:`motor._fast.ring`), named by
:func:`ring_names`: ``<prefix>-w<i>`` (feed -> worker) and ``<prefix>-h<i>`` (worker ->
feed). The feed process (:mod:`motor.coordinator.feed`) writes the first, the worker the
second. Record types are ``RECORD_USER + n``; integers are little-endian.

Feed -> worker records:

* ``TABLE`` (orjson): ``{"table": <InstanceTable JSON or null>, "slots": {key: [slot,
  generation]}, "events": [key...], "models": {key: {"ids": [model id...],
  "max_model_len": int or null}}, "adapters": [model id...]}``: the whole instance table
  (``null`` in standalone mode, where the workers know their backends) with the slot and
  generation of every endpoint key, the keys whose KV events are subscribed, and
  (controller mode) what each endpoint's engine lists on ``/v1/models`` (keys not read yet
  are absent) with the ids known to be LoRA adapters. Tables are small (one entry per
  instance) and every change sends the whole of it: there is no delta to lose.
* ``KV`` (binary): index operations already re-hashed by
  :class:`~motor.coordinator.kv.ingest.KvIngest` in the feed (:func:`encode_op`,
  :func:`decode_ops`), each ``<op u8, tier u8, slot u16, n u32, parent u64>`` then ``n``
  uint64 block hashes; op ``OP_STORE`` (1), ``OP_REMOVE`` (2), ``OP_CLEAR`` (3, the
  slot's blocks). An op is never split over two records.
* ``HINT`` (binary, :func:`encode_hint`): an approximate-mode insertion made by another
  worker, ``<slot u16, group length u16>`` + group (utf-8, empty: no group) + uint64
  hashes.
* ``SESSION`` (binary, :func:`encode_session`): another worker routed a named session's
  request to the endpoint of feed slot ``<slot u16>``; the session's name (bytes) follows.
* ``SNAP_BEGIN`` / ``SNAP_END`` (``<nonce u64>``, :func:`encode_nonce`): a snapshot
  follows / is complete: the worker clears its exact index, applies the ``TABLE`` and
  ``KV`` records in between, and is synced (ready to accept requests) at the end.

Worker -> feed records: ``HELLO <nonce u64>`` (I started, or I lost records: send me a
snapshot), ``HINT`` and ``SESSION`` (forwarded to every other worker).

A worker that sees a ring overflow record (``RECORD_OVERFLOW``, never produced by the
feed, kept as a safety net) asks for a snapshot.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import orjson

from motor._fast.ring import RECORD_OVERFLOW, RECORD_USER, Ring
from motor.coordinator.loadtable import LoadTable
from motor.protocol.instances import InstanceTable

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState, EndpointTable
    from motor.coordinator.kv.router import KvRouter
    from motor.coordinator.policy.sessions import SessionTable

logger = logging.getLogger(__name__)

#: record types
TABLE = RECORD_USER
KV = RECORD_USER + 1
HINT = RECORD_USER + 2
SNAP_BEGIN = RECORD_USER + 3
SNAP_END = RECORD_USER + 4
HELLO = RECORD_USER + 5
SESSION = RECORD_USER + 6

#: ``KV`` record operations
OP_STORE, OP_REMOVE, OP_CLEAR = 1, 2, 3
_OP = struct.Struct("<BBHIQ")
_HINT = struct.Struct("<HH")
_SESSION = struct.Struct("<H")
_NONCE = struct.Struct("<Q")
#: bytes of an op's header (its hashes follow, 8 bytes each)
OP_HEADER_BYTES = _OP.size


def ring_names(prefix: str, worker: int) -> tuple[str, str]:
    """(feed -> worker, worker -> feed) ring names of worker ``worker``."""
    return f"{prefix}-w{worker}", f"{prefix}-h{worker}"


def encode_op(op: int, slot: int, tier: int = 0, parent: int = 0,
              hashes: npt.ArrayLike | None = None) -> bytes:
    """One ``KV`` op: ``OP_STORE`` of ``hashes`` under ``parent`` (0: a root block) in
    ``tier``, ``OP_REMOVE`` of ``hashes``, or ``OP_CLEAR`` of ``slot``'s blocks."""
    h = b"" if hashes is None else np.ascontiguousarray(hashes, np.uint64).tobytes()
    return _OP.pack(op, tier, slot, len(h) // 8, parent) + h


def decode_ops(payload: bytes) -> list[tuple[int, int, int, int, npt.NDArray[np.uint64]]]:
    """(op, slot, tier, parent, hashes) of each op of one ``KV`` record (hashes are views
    of ``payload``).

    Raises
    ------
    struct.error, ValueError
        for a truncated payload.
    """
    out = []
    off = 0
    n_all = len(payload)
    while off < n_all:
        op, tier, slot, n, parent = _OP.unpack_from(payload, off)
        off += _OP.size
        hashes = np.frombuffer(payload, np.uint64, n, off)
        off += 8 * n
        out.append((op, slot, tier, parent, hashes))
    return out


def encode_nonce(nonce: int) -> bytes:
    """Payload of ``HELLO``, ``SNAP_BEGIN`` and ``SNAP_END`` (``nonce``: 0 .. 2**64-1)."""
    return _NONCE.pack(nonce)


def decode_nonce(payload: bytes) -> int:
    """The nonce of a ``HELLO`` / ``SNAP_BEGIN`` / ``SNAP_END`` payload.

    Raises
    ------
    struct.error
        when ``payload`` is not 8 bytes.
    """
    return int(_NONCE.unpack(payload)[0])


def encode_hint(slot: int, group: str | None, hashes: npt.ArrayLike) -> bytes:
    """A ``HINT`` payload: ``hashes`` were routed to the endpoint of feed slot ``slot``
    (instance group ``group``, None: none)."""
    g = (group or "").encode()
    return _HINT.pack(slot, len(g)) + g + np.ascontiguousarray(hashes, np.uint64).tobytes()


def decode_hint(payload: bytes) -> tuple[int, str | None, npt.NDArray[np.uint64]]:
    """(feed slot, group or None, hashes) of a ``HINT`` payload (hashes: a view of it).

    Raises
    ------
    struct.error, ValueError, UnicodeDecodeError
        for a malformed payload.
    """
    slot, glen = _HINT.unpack_from(payload)
    group = payload[_HINT.size:_HINT.size + glen].decode() or None
    return slot, group, np.frombuffer(payload, np.uint64, offset=_HINT.size + glen)


def encode_session(slot: int, session: bytes | str) -> bytes:
    """A ``SESSION`` payload: ``session`` (a header's bytes or the body's ``user``, UTF-8)
    was routed to the endpoint of feed slot ``slot``."""
    name = session.encode("utf-8", "surrogatepass") if isinstance(session, str) else session
    return _SESSION.pack(slot) + name


def decode_session(payload: bytes) -> tuple[int, bytes]:
    """(feed slot, session name) of a ``SESSION`` payload.

    Raises
    ------
    struct.error
        for a payload shorter than its slot.
    """
    (slot,) = _SESSION.unpack_from(payload)
    return slot, payload[_SESSION.size:]


class WorkerLink:
    """A worker's end of its two rings: applies the feed's records to the worker's
    :class:`~motor.coordinator.endpoints.EndpointTable`, its KV router (if any) and its
    load-table cells; sends routing hints (it installs itself as the router's
    :attr:`~motor.coordinator.kv.router.KvRouter.on_routed`) and, given the policy's
    ``sessions`` table, where this worker routed each named session (``kv_affinity``'s
    ``on_session``), and records the other workers' sessions in that table.

    ``synced`` is set once a snapshot for this worker's latest ``HELLO`` is applied
    (the worker listens only then).
    """

    def __init__(self, worker: int, load: LoadTable, ring: Ring, back: Ring,
                 table: EndpointTable, router: KvRouter | None = None,
                 static: bool = False, sessions: SessionTable | None = None) -> None:
        self.worker = worker
        self.load = load
        self.ring = ring
        self.back = back
        self.table = table
        self.router = router
        self.static = static
        self.synced = asyncio.Event()
        self.nonce = 0
        self._in_snapshot = False
        self._waiting_nonce = True
        self.key_of_slot: dict[int, str] = {}
        self.slots: dict[str, tuple[int, int]] = {}
        self.records = 0
        self.snapshots = 0
        self.hints_dropped = 0
        self.sessions = sessions
        if router is not None:
            router.on_routed = self.routed

    def routed(self, ep: EndpointState, group: str | None,
               hashes: npt.NDArray[np.uint64]) -> None:
        """An approximate-mode insertion of this worker (the router's ``on_routed``): goes
        to the feed, which forwards it to the other workers (dropped, and counted in
        ``hints_dropped``, when the ring to the feed is full)."""
        cell = ep.shared
        if cell is None:
            return
        if not self.back.try_push(HINT, encode_hint(cell.slot, group, hashes)):
            self.hints_dropped += 1

    def session_routed(self, session: bytes | str, ep: EndpointState) -> None:
        """This worker routed ``session``'s request to ``ep`` (the policy's ``on_session``):
        goes to the feed, which forwards it to the other workers (dropped, and counted in
        ``hints_dropped``, when the ring to the feed is full)."""
        cell = ep.shared
        if cell is None:
            return
        if not self.back.try_push(SESSION, encode_session(cell.slot, session)):
            self.hints_dropped += 1

    def hello(self) -> None:
        """Ask the feed for a snapshot (start, or records lost)."""
        self.nonce = int.from_bytes(os.urandom(8), "little") >> 1
        self._waiting_nonce = True
        while not self.back.try_push(HELLO, encode_nonce(self.nonce)):
            self.back.pop_many(1024)  # cannot happen in practice: the feed drains it

    def poll(self) -> int:
        """Apply what is in the ring now; returns the records handled."""
        recs = self.ring.pop_many(512)
        for t, p in recs:
            self.handle(t, p)
        self.records += len(recs)
        return len(recs)

    def handle(self, t: int, p: bytes) -> None:
        if t == SNAP_BEGIN:
            self._waiting_nonce = decode_nonce(p) != self.nonce
            if not self._waiting_nonce:
                self._in_snapshot = True
                if self.router is not None:
                    for s in self.router.slots().values():
                        self.router.exact.clear(s)
            return
        if self._waiting_nonce:
            return  # records for a predecessor of this worker, or before our snapshot
        if t == TABLE:
            self._table(orjson.loads(p))
        elif t == KV:
            self._kv(p)
        elif t == HINT:
            self._hint(p)
        elif t == SESSION:
            self._session(p)
        elif t == SNAP_END:
            self._in_snapshot = False
            self.snapshots += 1
            self.synced.set()
        elif t == RECORD_OVERFLOW:
            logger.warning("worker %d: records from the feed were lost; asking for a snapshot",
                           self.worker)
            self.hello()

    def _table(self, msg: dict[str, Any]) -> None:
        if msg["table"] is not None and not self.static:
            self.table.apply(InstanceTable.model_validate(msg["table"]))
            # what the engines list, read by the feed (a standalone worker reads it itself)
            for key, info in (msg.get("models") or {}).items():
                ep = self.table.endpoints.get(key)
                if ep is not None:
                    ep.set_learned(info["ids"])
                    ep.max_model_len = info["max_model_len"]
            self.table.adapters.update(msg.get("adapters") or ())
        self.slots = {k: (int(v[0]), int(v[1])) for k, v in msg["slots"].items()}
        self.key_of_slot = {s: k for k, (s, _) in self.slots.items()}
        for key, ep in self.table.endpoints.items():
            sg = self.slots.get(key)
            if sg is None:
                continue
            cur = ep.shared
            if cur is None or (cur.slot, cur.gen) != sg:
                self.rebind(ep, sg)
        if self.router is not None:
            r = self.router
            r.sync(self.table.endpoints.keys())
            ev = {s for k in msg["events"] if k in self.table.endpoints
                  and (s := r.slot_if_free(k)) is not None}
            r.event_slots.clear()
            r.event_slots.update(ev)

    def rebind(self, ep: Any, sg: tuple[int, int]) -> None:
        """Point ``ep`` at the cell of (slot, generation), carrying this worker's in-flight
        counts over (they are released on the new cell)."""
        cell = self.load.cell(self.worker, sg[0], sg[1])
        row = self.load.load[self.worker, sg[0]]
        row[:] = (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
                  ep.inflight_decode_tokens)
        self.load.row_gen[self.worker, sg[0]] = sg[1]
        ep.shared = cell

    def _local_slot(self, fslot: int) -> int | None:
        key = self.key_of_slot.get(fslot)
        if key is None or self.router is None or key not in self.table.endpoints:
            return None
        return self.router.slot_if_free(key)    # None: beyond the 256 KV slots

    def _kv(self, p: bytes) -> None:
        r = self.router
        if r is None:
            return
        now = r.clock()
        for op, fslot, tier, parent, hashes in decode_ops(p):
            s = self._local_slot(fslot)
            if s is None:
                continue
            if op == OP_STORE:
                r.exact.store(s, tier, parent, hashes, now)
            elif op == OP_REMOVE:
                r.exact.remove(s, tier, hashes)
            elif op == OP_CLEAR:
                r.exact.clear(s)
        r.update_gauges()

    def _hint(self, p: bytes) -> None:
        r = self.router
        if r is None:
            return
        fslot, group, hashes = decode_hint(p)
        s = self._local_slot(fslot)
        if s is None:
            return
        r.note_sent(s, group, hashes)

    def _session(self, p: bytes) -> None:
        if self.sessions is None:
            return
        fslot, name = decode_session(p)
        key = self.key_of_slot.get(fslot)
        if key is not None and key in self.table.endpoints:
            self.sessions.routed(name, key)

    async def run(self) -> None:
        self.hello()
        idle = 0
        while True:
            n = self.poll()
            idle = 0 if n else idle + 1
            await asyncio.sleep(0.001 if idle < 100 else 0.005)

    def close(self) -> None:
        self.ring.close()
        self.back.close()


__all__ = [
    "HELLO",
    "HINT",
    "KV",
    "OP_CLEAR",
    "OP_HEADER_BYTES",
    "OP_REMOVE",
    "OP_STORE",
    "SESSION",
    "SNAP_BEGIN",
    "SNAP_END",
    "TABLE",
    "WorkerLink",
    "decode_hint",
    "decode_nonce",
    "decode_ops",
    "decode_session",
    "encode_hint",
    "encode_nonce",
    "encode_op",
    "encode_session",
    "ring_names",
]
