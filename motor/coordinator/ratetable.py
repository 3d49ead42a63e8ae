"""The shared-memory rate-limit table of a multi-worker coordinator (``coordinator.workers > 1``).

With one worker the limits are plain in-process token buckets
(:class:`motor.coordinator.ratelimit.RateLimiter`) and there is no table. With several, the
kernel spreads connections over the workers (``SO_REUSEPORT``), so each key's limit has to
hold for the coordinator as a whole: every worker records what it admits in its own row of
this table and decides from the sum over all rows (:class:`SharedRateLimiter`).

One segment ``/dev/shm/<prefix>-rate`` (plain ``mmap`` of a file there, as the load table
:mod:`motor.coordinator.loadtable`), created by the supervisor when some limit is
configured, attached by every worker, unlinked at exit::

    header  uint64[8]                          magic, n_workers, n_slots, n_buckets,
                                               layout version, bucket width (µs), n_reserved
    tag     uint64[n_workers, n_slots]         hash of the key name worker w counts there
    epoch   int64[n_workers, n_slots, n_buckets]      absolute bucket number + 1 (0: never)
    used    float64[n_workers, n_slots, 2, n_buckets] requests, tokens admitted in each

**Time buckets.** Time (``time.monotonic``: one clock for every process of the machine) is
cut into buckets of ``BUCKET_S`` = 1/8 s; a cell keeps a ring of ``N_BUCKETS`` = 512 of
them (64 s). Bucket ``b`` lives at ring position ``b % N_BUCKETS``; the writer zeroes a
position whose epoch is not ``b + 1`` before counting into it, then sets the epoch.
Readers count the ``N_BUCKETS - 1`` newest buckets (63.875 s, the position recycled next
excluded) and ignore any other epoch.

**Decision (a token bucket, recomputed).** A one-process bucket of rate ``r`` (limit / 60)
and capacity ``cap`` (``r * burst_s``, at least 1) has, at ``now``, the level
``min(cap, min over s <= now of cap + r * (now - s) - used(s, now))``: the tightest window
ending now. A worker computes that minimum over the windows that start at bucket
boundaries (the summed consumption of all rows, newest bucket first, as one cumulative
sum; numpy), and admits as a one-process bucket does: a whole request left and a
non-negative token level. ``peek``, ``settle`` and the ``x-ratelimit-*`` headers read the
same shared level.

**Precision.** Over any window ``W`` of at most 63.875 s a key gets at most
``r * W + cap`` (the one-process bound) plus:

* ``r * BUCKET_S`` (1/8 s of the rate; 1/8 of a burst with ``burst_s`` = 1): windows are
  checked from bucket boundaries only, and what a bucket holds could have come late in it;
* one request (with its token estimate) per other worker: a worker reads the sums and
  writes its own cell within one synchronous call (no ``await`` in between), so at any
  instant at most one admission per worker can be decided and not yet visible to the
  others. Two workers admitting at the same instant may both take the last request.

Windows longer than the ring are not checked: over ``k`` ring spans a key may get ``k``
bursts instead of one (the 60 s figure is exact).

**Slots.** Every key name with a configured limit (``coordinator.limits.keys`` with
``rpm`` or ``tpm``) has a reserved slot (sorted names -> slots ``0..n_reserved-1``; every
worker has the same config). Any other name (the ``default`` limit: ``anonymous``, names
from the key file) hashes (BLAKE2b, 8 bytes) to one of ``n_hashed`` slots and may use that
one or the next ``PROBE - 1``: in its own row a worker takes the first slot of that window
already tagged with the name, else the first untagged or stale one (no bucket newer than
the ring) and tags it. Readers sum, over every row, the one cell of the window tagged with
the name. Each row has one writer, so nothing needs a lock or an atomic operation. When a
worker's row has no free slot in the name's window (``PROBE`` other names used there in
the last 64 s), that worker limits the name on its own at ``1 / workers`` of the limit
(the in-process bucket) until a slot frees up.

**Token corrections.** :meth:`SharedRateLimiter.settle` replaces an estimate by the
engine's count in the bucket where the request was admitted (found by key name and
estimate: requests of one key with the same estimate are interchangeable), as if the
request had taken its real count at admission. When that bucket left the ring, a count
larger than the estimate is charged now and a smaller one is dropped.

**Restarts.** A worker that died is replaced with its row reset
(:meth:`RateTable.reset_row`, by the supervisor before the successor starts, so there is a
single writer): what the dead worker admitted in the last minute is forgotten, so after a
crash a key may get up to one more window of what that worker had admitted.

**Cost** (``bench/bench_ratelimit.py``, one admission + its headers + settle, a key busy
in every row for the whole ring): about 28 µs with 2 workers and 39 µs with 8, against
3.6 µs for the in-process buckets (one core of a shared machine). The reads: ``n_workers``
tags per reserved name (``n_workers * PROBE`` for a hashed one), the name's cells
gathered (``n_workers x 511`` epochs and counts) and a few numpy reductions; the write: a
few memoryview stores in the worker's own row. The headers after an admission reuse the
levels it computed.

Memory ordering: as the load table, aligned 64-bit words written whole (no torn values on
x86-64 / arm64); the writer zeroes a recycled position before it sets its epoch, so a
reader never counts a previous ring turn's counts as the current bucket.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import time
from collections import deque
from collections.abc import Callable, Mapping

import numpy as np

from motor.coordinator.shm import attach_segment, create_segment, segment_path, unlink_segment

from motor.coordinator.ratelimit import Headers, Limit, RateLimiter, duration

MAGIC = 0x6D6F746F72726174  # "motorrat"
LAYOUT_VERSION = 1
HEADER_WORDS = 8
#: width of a time bucket, seconds
BUCKET_S = 0.125
#: buckets per cell (a ring of 64 s)
N_BUCKETS = 512
#: slots a hashed name may use (its home slot and the next ones)
PROBE = 8
#: hashed slots of a table by default
N_HASHED = 256
REQ, TOK = 0, 1


def name_hash(name: str) -> int:
    """The tag of ``name``: 8 bytes of BLAKE2b, never 0 (0 = untagged)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") or 1


def reserved_names(limits: Mapping[str, Limit]) -> list[str]:
    """The names with a reserved slot: those whose configured limit has ``rpm`` or
    ``tpm``, sorted (every worker and the supervisor compute the same list)."""
    return sorted(n for n, lim in limits.items() if lim.rpm or lim.tpm)


def _size(n_workers: int, n_slots: int, n_buckets: int) -> int:
    cells = n_workers * n_slots
    return 8 * (HEADER_WORDS + cells + cells * n_buckets * 3)


class RateTable:
    """The mapped segment; build with :meth:`create` (supervisor) or :meth:`attach`."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._mm = mm
        hdr = np.frombuffer(mm, np.uint64, HEADER_WORDS, 0)
        if int(hdr[0]) != MAGIC or int(hdr[4]) != LAYOUT_VERSION:
            raise ValueError(f"/dev/shm/{name} is not a motor rate table (layout "
                             f"{LAYOUT_VERSION}), got magic {int(hdr[0]):#x} "
                             f"version {int(hdr[4])}")
        self.n_workers = nw = int(hdr[1])
        self.n_slots = ns = int(hdr[2])
        self.n_buckets = nb = int(hdr[3])
        self.bucket_s = int(hdr[5]) / 1e6
        self.n_reserved = int(hdr[6])
        cells = nw * ns
        off = 8 * HEADER_WORDS
        self.tag = np.frombuffer(mm, np.uint64, cells, off).reshape(nw, ns)
        self._tag_mv = memoryview(mm)[off:off + 8 * cells].cast("Q")
        off += 8 * cells
        self.epoch = np.frombuffer(mm, np.int64, cells * nb, off).reshape(nw, ns, nb)
        self._epoch_mv = memoryview(mm)[off:off + 8 * cells * nb].cast("q")
        off += 8 * cells * nb
        self.used = np.frombuffer(mm, np.float64, cells * 2 * nb, off).reshape(nw, ns, 2, nb)
        self._used_mv = memoryview(mm)[off:off + 16 * cells * nb].cast("d")

    # -- lifecycle ----------------------------------------------------------------------
    @staticmethod
    def _path(name: str) -> str:
        return segment_path(name, "rate table")

    @classmethod
    def create(cls, name: str, n_workers: int, n_reserved: int = 0,
               n_hashed: int = N_HASHED) -> RateTable:
        """A new zeroed table of ``n_reserved + n_hashed`` slots; fails if ``name`` exists.

        Raises
        ------
        FileExistsError
            when ``/dev/shm/<name>`` exists.
        """
        if n_workers < 1 or n_reserved < 0 or n_hashed < 1:
            raise ValueError(f"n_workers and n_hashed are expected >= 1 and n_reserved >= 0, "
                             f"got {n_workers}, {n_hashed}, {n_reserved}")
        path = cls._path(name)
        n_slots = n_reserved + n_hashed
        size = _size(n_workers, n_slots, N_BUCKETS)
        mm = create_segment(path, size)
        hdr = np.frombuffer(mm, np.uint64, HEADER_WORDS, 0)
        hdr[1:7] = (n_workers, n_slots, N_BUCKETS, LAYOUT_VERSION, round(BUCKET_S * 1e6),
                    n_reserved)
        hdr[0] = MAGIC
        del hdr
        return cls(name, mm, True)

    @classmethod
    def attach(cls, name: str) -> RateTable:
        """Map an existing table.

        Raises
        ------
        FileNotFoundError
            when ``/dev/shm/<name>`` does not exist.
        ValueError
            when it is not a rate table.
        """
        return cls(name, attach_segment(cls._path(name)), False)

    def close(self) -> None:
        """Unmap (the arrays of this object are unusable afterwards)."""
        if self._mm.closed:
            return
        for a in ("tag", "epoch", "used"):
            setattr(self, a, None)
        for mv in (self._tag_mv, self._epoch_mv, self._used_mv):
            mv.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported somewhere: leave it to the GC
            pass

    def unlink(self) -> None:
        unlink_segment(self._path(self.name))

    def reset_row(self, worker: int) -> None:
        """Forget everything worker ``worker`` admitted (it died; call before its successor
        starts, so there is a single writer)."""
        self.used[worker] = 0.0
        self.epoch[worker] = 0
        self.tag[worker] = 0


class _Key:
    """What a worker knows of one key name: its limit, tag, slot window, own slot."""

    __slots__ = ("cap_req", "cap_tok", "rate_req", "rate_tok", "slot", "slots", "tag")

    def __init__(self, lim: Limit, burst_s: float, tag: int, slots: list[int]) -> None:
        self.rate_req = (lim.rpm or 0.0) / 60.0
        self.rate_tok = (lim.tpm or 0.0) / 60.0
        self.cap_req = max(1.0, self.rate_req * burst_s)
        self.cap_tok = max(1.0, self.rate_tok * burst_s)
        self.tag = tag
        self.slots = slots
        self.slot = -1     # own row's slot; -1: none yet (or none free: local fallback)


class SharedRateLimiter(RateLimiter):
    """:class:`RateLimiter`'s interface over a :class:`RateTable`: every key's limit holds
    for all the workers together (module docstring).

    Parameters
    ----------
    limits, default, burst_s, clock
        as :class:`RateLimiter`.
    table : RateTable
        the attached table.
    worker : int
        this worker's row.

    Raises
    ------
    ValueError
        when the table's reserved slots do not match ``limits`` or ``worker`` is out of
        range.
    """

    def __init__(self, limits: dict[str, Limit], default: Limit, burst_s: float,
                 table: RateTable, worker: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(limits, default, burst_s, share=1.0 / table.n_workers, clock=clock)
        reserved = reserved_names(limits)
        if len(reserved) != table.n_reserved or not 0 <= worker < table.n_workers:
            raise ValueError(f"rate table {table.name}: {table.n_reserved} reserved slot(s) "
                             f"and {table.n_workers} worker(s), this worker has "
                             f"{len(reserved)} limited name(s) and index {worker}")
        self.table = table
        self.worker = worker
        self._now: Callable[[], float] = clock
        self._reserved = {n: i for i, n in enumerate(reserved)}
        self._shared: dict[str, _Key | None] = {}
        self._slot_owner: dict[int, str] = {}      # own row: slot -> name cached there
        self._pending: dict[tuple[str, float], deque[int]] = {}
        nb = table.n_buckets
        self._w = table.bucket_s
        self._nb = nb
        self._steps = np.arange(nb - 1, dtype=np.int64)
        self._ages = self._steps * table.bucket_s
        self._last: tuple[str, float, float, float] | None = None

    # -- slots ----------------------------------------------------------------------------
    def _key(self, name: str) -> _Key | None:
        try:
            return self._shared[name]
        except KeyError:
            pass
        lim = self.limits.get(name, self.default)
        k = None
        if lim.rpm or lim.tpm:
            t = self.table
            if name in self._reserved:
                slots = [self._reserved[name]]
            else:
                nh = t.n_slots - t.n_reserved
                h = name_hash(name)
                slots = [t.n_reserved + (h + j) % nh for j in range(min(PROBE, nh))]
            k = _Key(lim, self.burst_s, name_hash(name), slots)
        self._shared[name] = k
        return k

    def _own_slot(self, k: _Key, name: str, bucket: int) -> int:
        """This worker's slot for ``k`` (claimed now if needed); -1 when none is free."""
        if k.slot >= 0:
            return k.slot
        t = self.table
        tags = t._tag_mv
        base = self.worker * t.n_slots
        for s in k.slots:
            if tags[base + s] == k.tag:       # e.g. cached before a name was forgotten
                k.slot = s
                self._slot_owner[s] = name
                return s
        for s in k.slots:
            old = tags[base + s]
            if old != 0 and int(t.epoch[self.worker, s].max()) - 1 > bucket - self._nb + 1:
                continue  # another name's, used within the ring
            prev = self._slot_owner.pop(s, None)
            if prev is not None:
                pk = self._shared.get(prev)
                if pk is not None:
                    pk.slot = -1
            tags[base + s] = k.tag           # its old buckets are all outside the window
            k.slot = s
            self._slot_owner[s] = name
            return s
        return -1

    # -- the shared view ------------------------------------------------------------------
    def _levels(self, k: _Key, now: float, bucket: int) -> tuple[float, float]:
        """(request level, token level) of ``k`` now, over every worker's row."""
        t = self.table
        tags = t._tag_mv
        ns = t.n_slots
        rows: list[int] = []
        slots: list[int] = []
        for w in range(t.n_workers):
            base = w * ns
            for s in k.slots:
                if tags[base + s] == k.tag:
                    rows.append(w)
                    slots.append(s)
                    break
        lreq, ltok = k.cap_req, k.cap_tok
        if not rows:
            return lreq, ltok
        nb = self._nb
        steps = self._steps
        order = (bucket - steps) % nb                  # ring positions, newest bucket first
        if len(set(slots)) == 1:                       # the usual case: one slot, a view
            ep = t.epoch[rows, slots[0]] if len(rows) < t.n_workers else t.epoch[:, slots[0]]
            used = t.used[rows, slots[0]] if len(rows) < t.n_workers else t.used[:, slots[0]]
        else:
            ep = t.epoch[rows, slots]
            used = t.used[rows, slots]
        valid = ep.take(order, axis=1) == (bucket + 1) - steps   # this ring turn's buckets
        # consumption from the start of the bucket of each age to now, all rows: (2, nb - 1)
        c = np.einsum("wkp,wp->kp", used.take(order, axis=2), valid)
        np.cumsum(c, axis=1, out=c)
        # the windows' lengths: age * w + (now - start of the current bucket)
        span = self._ages + (now - bucket * self._w)
        if k.rate_req:
            lreq = min(lreq, float((k.cap_req + k.rate_req * span - c[REQ]).min()))
        if k.rate_tok:
            ltok = min(ltok, float((k.cap_tok + k.rate_tok * span - c[TOK]).min()))
        return lreq, ltok

    def _record(self, slot: int, bucket: int, req: float, tok: float) -> None:
        """Count into this worker's cell (the single writer of its row)."""
        t = self.table
        nb = self._nb
        cell = self.worker * t.n_slots + slot
        pos = bucket % nb
        i = cell * nb + pos
        r = 2 * cell * nb + pos               # used[w, s, REQ, pos]; + nb: TOK
        ep = t._epoch_mv
        u = t._used_mv
        if ep[i] != bucket + 1:
            u[r] = 0.0
            u[r + nb] = 0.0
            ep[i] = bucket + 1
        u[r] += req
        u[r + nb] += tok

    def _refusal(self, k: _Key, lreq: float, ltok: float,
                 first: bool) -> tuple[float, str] | None:
        """(seconds to wait, which limit) when ``k`` cannot take a request now."""
        wr = max(0.0, (1.0 - lreq) / k.rate_req) if k.rate_req else 0.0
        wt = max(0.0, -ltok / k.rate_tok) if k.rate_tok else 0.0
        if first:       # peek: the first limit that refuses, requests before tokens
            if wr > 0.0:
                return wr, "requests"
            return (wt, "tokens") if wt > 0.0 else None
        if wr <= 0.0 and wt <= 0.0:
            return None
        return (wr, "requests") if wr >= wt else (wt, "tokens")

    # -- RateLimiter's interface ------------------------------------------------------------
    def admit(self, name: str, tokens: float) -> tuple[float, str, Headers] | None:
        k = self._key(name)
        if k is None:
            return None
        now = self._now()
        bucket = math.floor(now / self._w)
        slot = self._own_slot(k, name, bucket)
        if slot < 0:
            return super().admit(name, tokens)   # no free slot: this worker's share, alone
        lreq, ltok = self._levels(k, now, bucket)
        refused = self._refusal(k, lreq, ltok, False)
        if refused is not None:
            self._last = (name, now, lreq, ltok)
            return refused[0], refused[1], self._headers_of(k, lreq, ltok)
        self._record(slot, bucket, 1.0, tokens)
        if k.rate_tok:
            self._remember(name, tokens, bucket)
        self._last = (name, now, lreq - 1.0, ltok - tokens)
        return None

    def peek(self, name: str) -> tuple[float, str, Headers] | None:
        k = self._key(name)
        if k is None:
            return None
        if k.slot < 0 and self._own_slot(k, name, math.floor(self._now() / self._w)) < 0:
            return super().peek(name)
        now = self._now()
        lreq, ltok = self._levels(k, now, math.floor(now / self._w))
        refused = self._refusal(k, lreq, ltok, True)
        if refused is None:
            return None
        return refused[0], refused[1], self._headers_of(k, lreq, ltok)

    def settle(self, name: str, estimate: float, actual: float | None) -> None:
        k = self._shared.get(name)
        if k is None or not k.rate_tok:
            return
        if k.slot < 0:
            super().settle(name, estimate, actual)
            return
        q = self._pending.get((name, estimate))
        at = q.popleft() if q else None
        if q is not None and not q:
            del self._pending[(name, estimate)]
        if actual is None:
            return
        now = self._now()
        bucket = math.floor(now / self._w)
        t = self.table
        nb = self._nb
        if at is not None and at > bucket - nb + 1 and \
                t._epoch_mv[(self.worker * t.n_slots + k.slot) * nb + at % nb] == at + 1:
            self._record(k.slot, at, 0.0, actual - estimate)   # in the admission's bucket
        elif actual > estimate:
            self._record(k.slot, bucket, 0.0, actual - estimate)
        self._last = None

    def headers(self, name: str) -> Headers:
        k = self._shared.get(name)
        if k is None:
            return ()
        if k.slot < 0:
            return super().headers(name)
        now = self._now()
        last = self._last
        if last is not None and last[0] == name and now - last[1] < 0.001:
            return self._headers_of(k, last[2], last[3])   # just computed by admit
        lreq, ltok = self._levels(k, now, math.floor(now / self._w))
        return self._headers_of(k, lreq, ltok)

    def _headers_of(self, k: _Key, lreq: float, ltok: float) -> Headers:
        out: list[tuple[bytes, bytes]] = []
        for kind, rate, cap, level in (("requests", k.rate_req, k.cap_req, lreq),
                                       ("tokens", k.rate_tok, k.cap_tok, ltok)):
            if not rate:
                continue
            out += [(f"x-ratelimit-limit-{kind}".encode(), b"%d" % round(rate * 60)),
                    (f"x-ratelimit-remaining-{kind}".encode(), b"%d" % max(0, int(level))),
                    (f"x-ratelimit-reset-{kind}".encode(),
                     duration(max(0.0, (cap - level) / rate)).encode())]
        return tuple(out)

    def _remember(self, name: str, estimate: float, bucket: int) -> None:
        """The bucket of an admission whose estimate :meth:`settle` will correct."""
        q = self._pending.get((name, estimate))
        if q is None:
            q = self._pending[(name, estimate)] = deque()
        oldest = bucket - self._nb + 2
        while q and q[0] < oldest:
            q.popleft()    # its bucket left the ring: settle would find nothing anyway
        q.append(bucket)
        if len(self._pending) > 4096:
            for key in [kk for kk, qq in self._pending.items() if not qq or qq[-1] < oldest]:
                del self._pending[key]


__all__ = [
    "BUCKET_S",
    "N_BUCKETS",
    "PROBE",
    "RateTable",
    "SharedRateLimiter",
    "name_hash",
    "reserved_names",
]
