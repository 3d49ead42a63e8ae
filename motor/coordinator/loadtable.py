"""The shared-memory load table of a multi-worker coordinator (``coordinator.workers > 1``).

One segment ``/dev/shm/<name>`` (plain ``mmap`` of a file there, no resource tracker),
created by the supervisor, attached by every worker and by the feed::

    header   uint64[8]                         magic, n_workers, n_slots, layout version
    gen      uint64[n_slots]                   generation of each instance slot (feed writes)
    row_gen  uint64[n_workers, n_slots]        generation each worker's cell counts for
    load     int64[n_workers, n_slots, 4]      in-flight requests, in-flight tokens
                                               (prompt + max_tokens), prefill tokens, decode tokens
    eng_seq  uint64[n_slots]                   seqlock of the engine figures (feed writes)
    engine   float64[n_slots, 4]               waiting, running, KV cache usage (0..1),
                                               scrape time (unix seconds; 0: never scraped)
    ready    int64[n_workers, 3]               each worker's readiness: state (starting,
                                               listening, gone), synced (1 / 0), endpoints
                                               it routes to now

Writers, no locks:

* worker ``w`` writes only row ``w`` of ``row_gen``, ``load`` and ``ready`` (single
  writer per cell);
* the feed is the one authority on instance slots: it assigns a slot to an endpoint key
  and bumps ``gen[slot]`` when the endpoint leaves, before the slot is reused;
* the feed writes the engine figures of a slot between two increments of
  ``eng_seq[slot]`` (odd while writing); readers retry until they read the same even
  value before and after.

A request's prefill tokens leave the prefill column at its first token
(:meth:`LoadCell.prefill_done`, streamed answers); its request count, tokens and decode
tokens stay until it ends (:meth:`LoadCell.release`, with the prefill tokens still
counted), so every column returns to 0 on every path.

Slot recycling: a worker's :class:`LoadCell` is bound to ``(slot, gen)``. Crediting a
cell whose ``row_gen`` differs first resets it to the new generation, and a release
whose generation is no longer the row's does nothing, so counts of an instance that left
never land on the instance that reused its slot. Readers sum a slot's column over the
workers whose ``row_gen`` equals the generation they ask for.

A worker that died is replaced with its row reset (:meth:`LoadTable.reset_row`, called by
the supervisor before the new worker starts): the dead worker's in-flight load is gone
with it.

Readiness (:meth:`LoadTable.publish_ready`, :meth:`LoadTable.readiness`): with several
workers on one port a client's connection lands on any worker that listens, so the
coordinator is ready only when every such worker is. Each worker publishes its state,
whether its table is synced and how many endpoints it routes to now (every
:data:`READY_PUBLISH_S`, and on each ``/readiness`` it answers); any worker's
``/readiness`` answers from all the rows. States: :data:`STARTING` (a new table's rows: a
worker of the first start, counted as not ready, so that one worker ready first does not
make the coordinator ready), :data:`LISTENING` (its row counts) and :data:`GONE` (died,
being replaced, or draining: it takes no connection, its row is left out; the supervisor
marks a dead worker so at once, :meth:`LoadTable.worker_gone`).

The cells :meth:`LoadTable.cell` makes, and :meth:`LoadTable.totals`, are compiled
(:mod:`motor._fast.loadcell`: same words, same rules, a few loads and stores where the
Python :class:`LoadCell` below, the reference used without the extension, does about
twenty memoryview item operations per request).

With one worker (the default) there is no table: endpoints keep plain per-process
counters (:class:`motor.coordinator.endpoints.EndpointState`), and
:func:`load_columns` reads those.

Memory ordering: the writers and readers are different processes on one machine; the
cells are aligned 64-bit words, written whole (no torn values on x86-64 and arm64), and a
reader sums whatever values are current, which is what a load estimate needs. The
seqlock relies on the stores being seen in program order (x86-64 TSO); on weaker memory
models a torn engine-figure read is bounded to one scrape's worth of staleness.
"""
from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from motor.coordinator.shm import attach_segment, create_segment, segment_path, unlink_segment

try:
    from motor._fast import loadcell as _loadcell
except ImportError:  # pragma: no cover - the extension is not built
    _loadcell = None  # type: ignore[assignment]

MAGIC = 0x6D6F746F726C6474  # "motorldt"
LAYOUT_VERSION = 3
HEADER_WORDS = 8
#: load columns
INFLIGHT, TOKENS, PREFILL, DECODE = 0, 1, 2, 3
N_LOAD = 4
#: engine-figure columns
WAITING, RUNNING, KV_USAGE, SCRAPED_AT = 0, 1, 2, 3
N_ENGINE = 4
#: readiness columns, and the states of the first
STATE, SYNCED, ROUTABLE = 0, 1, 2
N_READY = 3
STARTING, LISTENING, GONE = 0, 1, 2
#: how often a worker publishes its readiness row (seconds)
READY_PUBLISH_S = 0.1


def _size(n_workers: int, n_slots: int) -> int:
    words = (HEADER_WORDS + n_slots + n_workers * n_slots + n_workers * n_slots * N_LOAD
             + n_slots + n_slots * N_ENGINE + n_workers * N_READY)
    return 8 * words


class LoadTable:
    """The mapped segment; build with :meth:`create` (supervisor) or :meth:`attach`.

    Parameters
    ----------
    name : str
        Segment name (a file in ``/dev/shm``), without a slash.
    """

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._mm = mm
        hdr = np.frombuffer(mm, np.uint64, HEADER_WORDS, 0)
        if int(hdr[0]) != MAGIC or int(hdr[3]) != LAYOUT_VERSION:
            raise ValueError(f"/dev/shm/{name} is not a motor load table (layout "
                             f"{LAYOUT_VERSION}), got magic {int(hdr[0]):#x} "
                             f"version {int(hdr[3])}")
        self.n_workers = nw = int(hdr[1])
        self.n_slots = ns = int(hdr[2])
        off = 8 * HEADER_WORDS
        self.gen = np.frombuffer(mm, np.uint64, ns, off)
        off += 8 * ns
        self.row_gen = np.frombuffer(mm, np.uint64, nw * ns, off).reshape(nw, ns)
        off += 8 * nw * ns
        self.load = np.frombuffer(mm, np.int64, nw * ns * N_LOAD, off).reshape(nw, ns, N_LOAD)
        off += 8 * nw * ns * N_LOAD
        self.eng_seq = np.frombuffer(mm, np.uint64, ns, off)
        off += 8 * ns
        self.engine = np.frombuffer(mm, np.float64, ns * N_ENGINE, off).reshape(ns, N_ENGINE)
        off += 8 * ns * N_ENGINE
        self.ready = np.frombuffer(mm, np.int64, nw * N_READY, off).reshape(nw, N_READY)
        # flat memoryviews: scalar access without numpy's per-item overhead (hot path)
        self._gen_mv = memoryview(mm)[8 * HEADER_WORDS:8 * (HEADER_WORDS + ns)].cast("Q")
        base = 8 * (HEADER_WORDS + ns)
        self._row_gen_mv = memoryview(mm)[base:base + 8 * nw * ns].cast("Q")
        base += 8 * nw * ns
        self._load_mv = memoryview(mm)[base:base + 8 * nw * ns * N_LOAD].cast("q")
        # the compiled cells' view of the same words (None: _fast not built, the Python
        # LoadCell and totals read the memoryviews above)
        self._cmap = None if _loadcell is None else \
            _loadcell.Mapping(mm, nw, ns, 8 * (HEADER_WORDS + ns), base)
        self._ccell = None if _loadcell is None else _loadcell.LoadCell

    # -- lifecycle ------------------------------------------------------------------
    @staticmethod
    def _path(name: str) -> str:
        return segment_path(name, "load table")

    @classmethod
    def create(cls, name: str, n_workers: int, n_slots: int = 256) -> LoadTable:
        """A new zeroed table (every slot at generation 1); fails if ``name`` exists.

        Raises
        ------
        FileExistsError
            when ``/dev/shm/<name>`` exists.
        """
        if n_workers < 1 or n_slots < 1:
            raise ValueError(f"n_workers and n_slots are expected >= 1, got "
                             f"{n_workers}, {n_slots}")
        path = cls._path(name)
        size = _size(n_workers, n_slots)
        mm = create_segment(path, size)
        hdr = np.frombuffer(mm, np.uint64, HEADER_WORDS, 0)
        hdr[1], hdr[2], hdr[3] = n_workers, n_slots, LAYOUT_VERSION
        hdr[0] = MAGIC
        t = cls(name, mm, True)
        t.gen[:] = 1
        return t

    @classmethod
    def attach(cls, name: str) -> LoadTable:
        """Map an existing table.

        Raises
        ------
        FileNotFoundError
            when ``/dev/shm/<name>`` does not exist.
        ValueError
            when it is not a load table.
        """
        return cls(name, attach_segment(cls._path(name)), False)

    def close(self) -> None:
        """Unmap (the arrays of this object are unusable afterwards)."""
        if self._mm.closed:
            return
        for a in ("gen", "row_gen", "load", "eng_seq", "engine", "ready"):
            setattr(self, a, None)
        if self._cmap is not None:
            self._cmap.release()   # the compiled cells raise ValueError from now on
        for mv in (self._gen_mv, self._row_gen_mv, self._load_mv):
            mv.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported somewhere: leave it to the GC
            pass

    def unlink(self) -> None:
        unlink_segment(self._path(self.name))

    # -- slots (feed) ---------------------------------------------------------------
    def slot_gen(self, slot: int) -> int:
        return int(self._gen_mv[slot])

    def retire(self, slot: int) -> int:
        """The instance of ``slot`` left: bump its generation (its cells stop counting) and
        clear its engine figures; returns the new generation."""
        g = self._gen_mv[slot] + 1
        self._gen_mv[slot] = g
        self.write_engine(slot, 0.0, 0.0, 0.0, 0.0)
        return g

    # -- rows (supervisor / workers) -------------------------------------------------
    def reset_row(self, worker: int, gone: bool = False) -> None:
        """Forget everything worker ``worker`` counted and published (it died; call
        before its successor starts, so there is a single writer). ``gone``: its readiness
        row reads :data:`GONE` until the successor listens (a replacement), else
        :data:`STARTING`."""
        self.load[worker] = 0
        self.row_gen[worker] = 0
        self.ready[worker] = (GONE if gone else STARTING, 0, 0)

    def worker_gone(self, worker: int) -> None:
        """Worker ``worker`` takes no connection (it died): its readiness row is left out."""
        self.ready[worker, STATE] = GONE

    def publish_ready(self, worker: int, state: int, synced: bool, routable: int) -> None:
        """Worker ``worker``'s readiness: ``state`` (:data:`LISTENING`, :data:`STARTING`
        or :data:`GONE`), its table ``synced``, ``routable`` endpoints routed to now."""
        row = self.ready[worker]
        row[ROUTABLE] = routable
        row[SYNCED] = 1 if synced else 0
        row[STATE] = state

    def readiness(self) -> list[tuple[int, bool, int]]:
        """(state, synced, routable endpoints) of every worker, by index, as last
        published (a worker that has not published yet: ``(STARTING, False, 0)``)."""
        return [(int(st), bool(s), int(r)) for st, s, r in self.ready.tolist()]

    def cell(self, worker: int, slot: int, gen: int) -> LoadCell:
        """Worker ``worker``'s cell of ``slot`` at generation ``gen``: the compiled
        :class:`motor._fast.loadcell.LoadCell` (same interface and effects) when built,
        the Python :class:`LoadCell` otherwise.

        Raises
        ------
        ValueError
            for a worker, slot or generation out of range.
        """
        if self._ccell is not None:
            return cast(LoadCell, self._ccell(self, worker, slot, gen))
        return LoadCell(self, worker, slot, gen)

    # -- reads -------------------------------------------------------------------------
    def totals(self, slot: int, gen: int) -> tuple[int, int, int, int]:
        """(in-flight requests, tokens, prefill tokens, decode tokens) of ``slot`` at
        generation ``gen``, summed over workers."""
        if self._cmap is not None:
            return self._cmap.totals(slot, gen)
        rg = self._row_gen_mv
        ld = self._load_mv
        ns = self.n_slots
        n = t = p = d = 0
        for w in range(self.n_workers):
            if rg[w * ns + slot] == gen:
                b = (w * ns + slot) * N_LOAD
                n += ld[b]
                t += ld[b + 1]
                p += ld[b + 2]
                d += ld[b + 3]
        return n, t, p, d

    def columns(self, slots: npt.NDArray[np.intp], gens: npt.NDArray[np.uint64]
                ) -> npt.NDArray[np.int64]:
        """int64[len(slots), 4]: :meth:`totals` of many slots at once."""
        mask = self.row_gen[:, slots] == gens[None, :]
        out: npt.NDArray[np.int64] = (self.load[:, slots, :] * mask[:, :, None]).sum(axis=0)
        return out

    def write_engine(self, slot: int, waiting: float, running: float, kv_usage: float,
                     scraped_at: float) -> None:
        """Engine figures of ``slot`` (feed only: one writer)."""
        seq = self.eng_seq
        seq[slot] += 1
        self.engine[slot] = (waiting, running, kv_usage, scraped_at)
        seq[slot] += 1

    def read_engine(self, slot: int) -> tuple[float, float, float, float]:
        """(waiting, running, KV usage, scrape time) of ``slot``, consistent (seqlock)."""
        seq = self.eng_seq
        while True:
            s1 = int(seq[slot])
            if s1 & 1:
                continue
            w, r, k, t = self.engine[slot].tolist()
            if int(seq[slot]) == s1:
                return w, r, k, t


class LoadCell:
    """Worker ``worker``'s cell of one endpoint (slot at generation ``gen``): the
    pure-Python reference of :class:`motor._fast.loadcell.LoadCell`, which
    :meth:`LoadTable.cell` makes when the extension is built."""

    __slots__ = ("_b", "_ld", "_rg", "_ri", "gen", "slot", "table", "worker")

    def __init__(self, table: LoadTable, worker: int, slot: int, gen: int) -> None:
        if not 0 <= worker < table.n_workers or not 0 <= slot < table.n_slots or gen < 1:
            raise ValueError(f"load cell out of range: worker {worker} of {table.n_workers}, "
                             f"slot {slot} of {table.n_slots}, generation {gen}")
        self.table = table
        self.worker = worker
        self.slot = slot
        self.gen = gen
        self._rg = table._row_gen_mv
        self._ld = table._load_mv
        self._ri = worker * table.n_slots + slot
        self._b = self._ri * N_LOAD

    def acquire(self, tokens: int, prefill_tokens: int, decode_tokens: int) -> None:
        ld = self._ld
        b = self._b
        if self._rg[self._ri] != self.gen:
            # first credit of this generation here (or the slot was reused): start at 0
            ld[b] = ld[b + 1] = ld[b + 2] = ld[b + 3] = 0
            self._rg[self._ri] = self.gen
        ld[b] += 1
        ld[b + 1] += tokens
        ld[b + 2] += prefill_tokens
        ld[b + 3] += decode_tokens

    def release(self, tokens: int, prefill_tokens: int, decode_tokens: int) -> None:
        if self._rg[self._ri] != self.gen:
            return  # the row was reset or the slot reused since: nothing of ours left there
        ld = self._ld
        b = self._b
        ld[b] -= 1
        ld[b + 1] -= tokens
        ld[b + 2] -= prefill_tokens
        ld[b + 3] -= decode_tokens

    def prefill_done(self, prefill_tokens: int) -> None:
        """A request's prefill finished (its first token came): its ``prefill_tokens`` leave
        the prefill column; the request count and the other columns stay until
        :meth:`release`, which then passes the prefill tokens still counted (0)."""
        if self._rg[self._ri] != self.gen:
            return  # reset or reused since (as in release)
        self._ld[self._b + 2] -= prefill_tokens

    def totals(self) -> tuple[int, int, int, int]:
        """Summed over all workers (see :meth:`LoadTable.totals`)."""
        return self.table.totals(self.slot, self.gen)

    def mine(self) -> tuple[int, int, int, int]:
        """This worker's own counts."""
        if self._rg[self._ri] != self.gen:
            return 0, 0, 0, 0
        ld = self._ld
        b = self._b
        return ld[b], ld[b + 1], ld[b + 2], ld[b + 3]


class EndpointLoad(Protocol):
    """What :func:`load_columns` reads of an endpoint
    (:class:`motor.coordinator.endpoints.EndpointState`): its own in-flight counters and,
    with several workers, its cell of the shared table (None with one worker)."""

    @property
    def inflight(self) -> int: ...
    @property
    def inflight_prefill_tokens(self) -> int: ...
    @property
    def inflight_decode_tokens(self) -> int: ...
    @property
    def shared(self) -> LoadCell | None: ...


#: per candidate: (prefill tokens, decode tokens, requests) in flight, float64[k] each
Columns = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]


def load_columns(cands: Sequence[EndpointLoad]
                 ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64],
                            npt.NDArray[np.float64]]:
    """(prefill tokens, decode tokens, requests) in flight per candidate, float64 arrays:
    summed over all workers when the endpoints have shared cells, this process's counters
    otherwise."""
    k = len(cands)
    c0 = getattr(cands[0], "shared", None) if k else None
    if c0 is None or any(getattr(e, "shared", None) is None for e in cands):
        return (np.fromiter((e.inflight_prefill_tokens for e in cands), np.float64, k),
                np.fromiter((e.inflight_decode_tokens for e in cands), np.float64, k),
                np.fromiter((e.inflight for e in cands), np.float64, k))
    table = c0.table
    slots = np.fromiter((e.shared.slot for e in cands), np.intp, k)  # type: ignore[union-attr]
    gens = np.fromiter((e.shared.gen for e in cands), np.uint64, k)  # type: ignore[union-attr]
    cols = np.ascontiguousarray(table.columns(slots, gens).T, np.float64)
    return cols[PREFILL], cols[DECODE], cols[INFLIGHT]


__all__ = [
    "Columns",
    "DECODE",
    "INFLIGHT",
    "KV_USAGE",
    "PREFILL",
    "RUNNING",
    "SCRAPED_AT",
    "TOKENS",
    "WAITING",
    "EndpointLoad",
    "LoadCell",
    "LoadTable",
    "load_columns",
]
