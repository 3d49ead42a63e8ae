"""The feed process of a multi-worker coordinator, and each worker's end of its rings.

One feed process (started by :mod:`motor.coordinator.supervisor`) is the only subscriber
to the controller's instance table, to the engines' KV events and to their ``/metrics``;
it is the one authority on instance slots of the load table
(:mod:`motor.coordinator.loadtable`). It writes ordered records into one SPSC ring per
worker (:mod:`motor._fast.ring`, ``<prefix>-w<i>``); each worker writes routing hints
and requests into a ring of its own back to the feed (``<prefix>-h<i>``).

Feed -> worker records (``RECORD_USER`` + n):

* ``TABLE`` (orjson): the whole instance table (``null`` in standalone mode, where the
  workers know their backends) with the slot and generation of every endpoint key, and
  the keys whose KV events are subscribed. Tables are small (one entry per instance) and
  every change sends the whole of it: there is no delta to lose.
* ``KV`` (binary): index operations already re-hashed by
  :class:`~motor.coordinator.kv.ingest.KvIngest` in the feed, each
  ``<op u8, tier u8, slot u16, n u32, parent u64>`` then ``n`` uint64 block hashes;
  op 1 store, 2 remove, 3 clear (the slot's blocks).
* ``HINT`` (binary): an approximate-mode insertion made by another worker,
  ``<slot u16, group length u16>`` + group (utf-8) + uint64 hashes.
* ``SNAP_BEGIN`` / ``SNAP_END`` (``<nonce u64>``): a snapshot follows / is complete: the
  worker clears its exact index, applies the ``TABLE`` and ``KV`` records in between,
  and is synced (ready to accept requests) at the end.

Worker -> feed records: ``HELLO <nonce u64>`` (I started, or I lost records: send me a
snapshot) and ``HINT`` (forwarded to every other worker).

Nothing is silently lost: the feed keeps an outbox per worker and moves records into the
ring with ``try_push`` as space frees up. A worker that falls behind by more than
``coordinator.feed.max_backlog_records`` (or a dead worker) gets its outbox dropped and
a fresh snapshot queued instead (metric-free log line ``worker i fell behind``). A worker
that sees a ring overflow record (never produced by this feed, kept as a safety net)
asks for a snapshot. A restarted worker sends ``HELLO`` and accepts no request before
its ``SNAP_END``.

Engine figures: every ``coordinator.feed.scrape_interval_s`` the feed reads each ready
endpoint's ``/metrics`` (vLLM ``vllm:num_requests_waiting`` / ``num_requests_running`` /
``kv_cache_usage_perc``, SGLang ``sglang:num_queue_reqs`` / ``num_running_reqs`` /
``token_usage``) into the load table's engine figures.

Management API (``coordinator.management_port``, served by the feed): ``/liveness``,
``/readiness`` (every worker synced and some endpoint ready), ``/instances`` (the table
with slots, the load summed over workers and the engine figures) and ``/metrics``
(prometheus multiprocess aggregation over all workers and the feed).
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections import deque
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from motor.aio import cancel_and_wait
from motor._fast.ring import RECORD_OVERFLOW, RECORD_USER, Ring
from motor.config.schema import ClusterConfig
from motor.coordinator.loadtable import LoadTable
from motor.protocol.instances import InstanceState, InstanceTable

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointTable
    from motor.coordinator.kv.router import KvRouter

logger = logging.getLogger(__name__)

TABLE = RECORD_USER
KV = RECORD_USER + 1
HINT = RECORD_USER + 2
SNAP_BEGIN = RECORD_USER + 3
SNAP_END = RECORD_USER + 4
HELLO = RECORD_USER + 5

OP_STORE, OP_REMOVE, OP_CLEAR = 1, 2, 3
_OP = struct.Struct("<BBHIQ")
_HINT = struct.Struct("<HH")
_NONCE = struct.Struct("<Q")


def ring_names(prefix: str, worker: int) -> tuple[str, str]:
    """(feed -> worker, worker -> feed) ring names of worker ``worker``."""
    return f"{prefix}-w{worker}", f"{prefix}-h{worker}"


def encode_op(op: int, slot: int, tier: int = 0, parent: int = 0,
              hashes: np.ndarray | None = None) -> bytes:
    h = b"" if hashes is None else np.ascontiguousarray(hashes, np.uint64).tobytes()
    return _OP.pack(op, tier, slot, len(h) // 8, parent) + h


def decode_ops(payload: bytes) -> list[tuple[int, int, int, int, np.ndarray]]:
    """(op, slot, tier, parent, hashes) of one ``KV`` record."""
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


# =============================================================================
# feed side
# =============================================================================
class RecordingIndex:
    """What :class:`~motor.coordinator.kv.ingest.KvIngest` writes to in the feed: instead
    of a radix tree, each operation is encoded for the workers (and kept, one dict entry
    per held block, so that a snapshot can replay the current holdings)."""

    def __init__(self, on_ops: Any, max_payload: int = 1 << 20) -> None:
        self.on_ops = on_ops
        self.max_payload = max_payload
        # hashes per op so that one op always fits a record
        self.max_hashes = max(1, (max_payload - _OP.size) // 8)
        self.buf: list[bytes] = []
        # (slot, tier) -> {motor hash: parent hash}, in store order (parents first)
        self.held: dict[tuple[int, int], dict[int, int]] = {}

    def store(self, instance: int, tier: int, parent_hash: int, block_hashes: Any,
              now: float = 0.0) -> int:
        hl = np.asarray(block_hashes, np.uint64)
        m = self.held.setdefault((instance, tier), {})
        p = int(parent_hash)
        for h in hl.tolist():
            m[h] = p
            p = h
        k = self.max_hashes
        p = int(parent_hash)
        for j in range(0, len(hl), k):
            part = hl[j:j + k]
            self.buf.append(encode_op(OP_STORE, instance, tier, p, part))
            p = int(part[-1])
        self.on_ops()
        return len(hl)

    def remove(self, instance: int, tier: int, block_hashes: Any) -> int:
        hl = np.asarray(block_hashes, np.uint64)
        m = self.held.get((instance, tier), {})
        for h in hl.tolist():
            m.pop(h, None)
        k = self.max_hashes
        for j in range(0, len(hl), k):
            self.buf.append(encode_op(OP_REMOVE, instance, tier, 0, hl[j:j + k]))
        self.on_ops()
        return len(hl)

    def clear(self, instance: int) -> int:
        n = 0
        for tier in range(3):
            n += len(self.held.pop((instance, tier), {}))
        self.buf.append(encode_op(OP_CLEAR, instance))
        self.on_ops()
        return n

    def _pack(self, ops: list[bytes]) -> list[bytes]:
        """Ops -> record payloads of at most ``max_payload`` bytes (ops are never split)."""
        out: list[bytes] = []
        cur: list[bytes] = []
        size = 0
        for op in ops:
            if cur and size + len(op) > self.max_payload:
                out.append(b"".join(cur))
                cur, size = [], 0
            cur.append(op)
            size += len(op)
        if cur:
            out.append(b"".join(cur))
        return out

    def take(self) -> list[bytes]:
        out = self._pack(self.buf)
        self.buf.clear()
        return out

    def snapshot(self) -> list[bytes]:
        """``KV`` payloads that rebuild the current holdings from an empty index: chains
        of consecutive blocks as one store each."""
        ops: list[bytes] = []
        k = self.max_hashes
        for (slot, tier), m in self.held.items():
            run: list[int] = []
            run_parent = 0
            for h, p in m.items():
                if run and p == run[-1] and len(run) < k:
                    run.append(h)
                    continue
                if run:
                    ops.append(encode_op(OP_STORE, slot, tier, run_parent,
                                         np.array(run, np.uint64)))
                run, run_parent = [h], p
            if run:
                ops.append(encode_op(OP_STORE, slot, tier, run_parent, np.array(run, np.uint64)))
        return self._pack(ops)


class FeedKv:
    """The ``router`` that :class:`~motor.coordinator.kv.subscriber.KvEventSubscriber` and
    :class:`~motor.coordinator.kv.subscriber.KvEventFeed` expect, in the feed: slots come
    from the feed's allocator, the index records operations for the workers."""

    def __init__(self, feed: Feed) -> None:
        from motor.coordinator import metrics
        from motor.coordinator.kv.ingest import KvIngest
        self.feed = feed
        self.cfg = feed.cfg.coordinator.kv
        self.block_size = self.cfg.block_size
        self.clock = time.monotonic
        self.index = RecordingIndex(feed.schedule_flush)
        self.ingest = KvIngest(self.index, self.block_size,  # type: ignore[arg-type]
                               on_drop=lambda r, n: metrics.KV_EVENTS_DROPPED.labels(r).inc(n),
                               on_apply=lambda k, n: metrics.KV_EVENTS_APPLIED.labels(k).inc(n))
        self.event_slots: set[int] = set()

    def slot(self, key: str) -> int:
        s = self.feed.slots[key][0]
        self.ingest.add_slot(s, key)
        return s

    def sync(self, keys: Any) -> None:
        """Slots are freed by the feed's allocator (:meth:`Feed.set_endpoints`)."""

    def purge(self, key: str, reason: str) -> int:
        sg = self.feed.slots.get(key)
        return 0 if sg is None else self.ingest.purge(sg[0])

    def update_gauges(self, force: bool = False) -> None:
        pass


class _Outbox:
    __slots__ = ("back", "nonce", "queue", "ring", "synced")

    def __init__(self, ring: Ring, back: Ring) -> None:
        self.ring = ring
        self.back = back
        self.queue: deque[tuple[int, bytes]] = deque()
        self.synced = False   # has been sent a complete snapshot
        self.nonce = 0


class Feed:
    """The feed's state and loops (run in its own process by :func:`feed_main`).

    Parameters
    ----------
    cfg : ClusterConfig
    load : LoadTable
        Attached load table (slot authority: generations, engine figures).
    rings : list of (Ring, Ring)
        Per worker: (feed -> worker, worker -> feed), attached.
    static_keys : list of (key, kv_events address or None), optional
        Standalone mode: the fixed endpoints (``backend-i#0``); otherwise the controller.
    controller_url : str, optional
    """

    def __init__(self, cfg: ClusterConfig, load: LoadTable, rings: list[tuple[Ring, Ring]],
                 static_keys: list[tuple[str, str | None, str]] | None = None,
                 controller_url: str | None = None) -> None:
        self.cfg = cfg
        self.load = load
        self.out = [_Outbox(w, h) for w, h in rings]
        self.static_keys = static_keys
        self.controller_url = controller_url or cfg.controller.url
        self.slots: dict[str, tuple[int, int]] = {}
        self._free = list(range(load.n_slots - 1, -1, -1))
        # a restarted feed does not know what a previous one assigned: every generation moves
        for s in range(load.n_slots):
            load.retire(s)
        self.table: InstanceTable | None = None
        self.endpoints: dict[str, SimpleNamespace] = {}
        self.ep_table = SimpleNamespace(endpoints=self.endpoints, changed=asyncio.Event())
        self.kv = FeedKv(self)
        # a record may take at most half a ring (motor._fast.ring)
        self.kv.index.max_payload = min(r.capacity for r, _ in rings) // 2 - 64
        self.kv.index.max_hashes = max(1, (self.kv.index.max_payload - _OP.size) // 8)
        self.kv_feed: Any = None
        self._flush_scheduled = False
        self.wake = asyncio.Event()
        self.max_backlog = cfg.coordinator.feed.max_backlog_records
        self.synced_table = asyncio.Event()

    # -- slots --------------------------------------------------------------------
    def set_endpoints(self, eps: dict[str, SimpleNamespace]) -> None:
        """The endpoints now known (key -> url, kv_events, dp_rank...): assign slots to new
        ones, retire the slots of gone ones, resubscribe KV events, tell every worker."""
        for key in [k for k in self.slots if k not in eps]:
            slot, _ = self.slots.pop(key)
            if self.kv_feed is not None:
                self.kv.ingest.drop_slot(slot)   # records a clear for the workers
            self.kv.event_slots.discard(slot)
            self.load.retire(slot)
            self._free.append(slot)
        for key in eps:
            if key not in self.slots:
                if not self._free:
                    logger.error("load table full (%d slots): endpoint %s gets no slot",
                                 self.load.n_slots, key)
                    continue
                s = self._free.pop()
                self.slots[key] = (s, self.load.slot_gen(s))
        self.endpoints.clear()
        self.endpoints.update({k: v for k, v in eps.items() if k in self.slots})
        if self.kv_feed is not None:
            self.kv_feed.sync()
        self.flush_kv()
        self.broadcast(TABLE, self._table_payload())
        self.synced_table.set()

    def _table_payload(self) -> bytes:
        ev_keys = [k for k, (s, _) in self.slots.items() if s in self.kv.event_slots]
        return orjson.dumps({
            "table": None if self.table is None else self.table.model_dump(mode="json"),
            "slots": self.slots, "events": ev_keys})

    # -- records ------------------------------------------------------------------
    def broadcast(self, rtype: int, payload: bytes, skip: int = -1) -> None:
        for i, o in enumerate(self.out):
            if i != skip and o.synced:
                o.queue.append((rtype, payload))
        self.drain()

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush_kv)

    def flush_kv(self) -> None:
        self._flush_scheduled = False
        if self.kv.index.buf:
            for p in self.kv.index.take():
                self.broadcast(KV, p)

    def snapshot(self, i: int, nonce: int) -> None:
        o = self.out[i]
        o.queue.clear()
        o.nonce = nonce
        q = o.queue
        q.append((SNAP_BEGIN, _NONCE.pack(nonce)))
        if self.synced_table.is_set():
            q.append((TABLE, self._table_payload()))
        for p in self.kv.index.snapshot():
            q.append((KV, p))
        q.append((SNAP_END, _NONCE.pack(nonce)))
        o.synced = True
        logger.info("worker %d: snapshot queued (%d record(s), %d slot(s))", i, len(q),
                    len(self.slots))
        self.drain()

    def drain(self) -> None:
        """Move queued records into the rings while they fit; a backlog past the cap is
        replaced by a snapshot."""
        for i, o in enumerate(self.out):
            q = o.queue
            while q:
                t, p = q[0]
                if not o.ring.try_push(t, p):
                    break
                q.popleft()
            if len(q) > self.max_backlog:
                logger.warning("worker %d fell behind (%d record(s) waiting): its backlog is "
                               "dropped, a snapshot replaces it", i, len(q))
                self.snapshot(i, o.nonce)

    async def pump(self) -> None:
        """Worker -> feed records, and the outboxes' progress."""
        idle = 0
        while True:
            busy = False
            for i, o in enumerate(self.out):
                for t, p in o.back.pop_many(256):
                    busy = True
                    if t == HELLO:
                        (nonce,) = _NONCE.unpack(p)
                        logger.info("worker %d asks for a snapshot", i)
                        self.snapshot(i, nonce)
                    elif t == HINT:
                        self.broadcast(HINT, p, skip=i)
                    elif t == RECORD_OVERFLOW:
                        logger.warning("worker %d: hints dropped (its ring to the feed was "
                                       "full)", i)
            if any(o.queue for o in self.out):
                self.drain()
            idle = 0 if busy else idle + 1
            await asyncio.sleep(0.001 if idle < 100 else 0.005)

    # -- sources ------------------------------------------------------------------
    async def follow_controller(self) -> None:
        from urllib.parse import urlsplit

        from motor.http.client import Client
        u = urlsplit(self.controller_url)
        host, port = u.hostname or "127.0.0.1", u.port or 80
        client = Client(max_connections_per_endpoint=2, connect_timeout_s=2.0)
        version = -1
        down = False
        try:
            while True:
                after = max(version, 0)
                try:
                    status, body = await client.get_json_bytes(
                        host, port, f"/v1/instances?after={after}&timeout=10", 15.0)
                    if status != 200:
                        raise ConnectionError(f"controller answered {status}")
                    table = InstanceTable.model_validate(orjson.loads(body))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - retry; workers keep the last table
                    if not down:
                        logger.warning("feed: controller %s unreachable (%s); retrying",
                                       self.controller_url, e)
                        down = True
                    await asyncio.sleep(0.5)
                    continue
                down = False
                if table.version != version:
                    version = table.version
                    self.table = table
                    eps = {}
                    for inst in table.instances:
                        if inst.state == InstanceState.REMOVED:
                            continue
                        for spec in inst.endpoints:
                            key = f"{inst.id}#{spec.dp_rank}"
                            eps[key] = SimpleNamespace(
                                key=key, kv_events=inst.kv_events, dp_rank=spec.dp_rank,
                                host=spec.host, port=spec.port,
                                ready=inst.state == InstanceState.READY)
                    self.set_endpoints(eps)
        finally:
            client.close()

    async def scrape(self) -> None:
        from motor.http.client import Client
        interval = self.cfg.coordinator.feed.scrape_interval_s
        client = Client(max_connections_per_endpoint=1, connect_timeout_s=1.0)
        try:
            while True:
                await asyncio.sleep(interval)
                eps = [(k, e) for k, e in self.endpoints.items() if getattr(e, "ready", True)]
                await asyncio.gather(*(self._scrape_one(client, k, e) for k, e in eps))
        finally:
            client.close()

    async def _scrape_one(self, client: Any, key: str, ep: SimpleNamespace) -> None:
        try:
            status, body = await client.get_json_bytes(ep.host, ep.port, "/metrics", 2.0)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - an engine without /metrics: no figures
            return
        sg = self.slots.get(key)
        if status != 200 or sg is None:
            return
        w, r, k = parse_engine_metrics(body.decode(errors="replace"))
        self.load.write_engine(sg[0], w, r, k, time.time())

    async def run(self, stop: asyncio.Event) -> None:
        from motor.coordinator.kv.subscriber import KvEventFeed
        c = self.cfg.coordinator
        tasks = [asyncio.ensure_future(self.pump())]
        if c.policy.value == "kv_affinity" and c.kv.events.enabled:
            self.kv_feed = KvEventFeed(self.kv, self.ep_table)  # type: ignore[arg-type]
        if self.static_keys is not None:
            self.set_endpoints({k: SimpleNamespace(key=k, kv_events=ev, dp_rank=0,
                                                   host=url.split("//")[1].rsplit(":", 1)[0],
                                                   port=int(url.rsplit(":", 1)[1]))
                                for k, ev, url in self.static_keys})
        else:
            tasks.append(asyncio.ensure_future(self.follow_controller()))
        if c.feed.scrape_interval_s > 0:
            tasks.append(asyncio.ensure_future(self.scrape()))
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(*tasks)
            if self.kv_feed is not None:
                self.kv_feed.close()

    # -- management API -------------------------------------------------------------
    def instances(self) -> dict[str, Any]:
        out = []
        for key, (slot, gen) in sorted(self.slots.items()):
            n, tok, pre, dec = self.load.totals(slot, gen)
            w, r, k, ts = self.load.read_engine(slot)
            e = self.endpoints.get(key)
            out.append({"key": key, "slot": slot, "generation": gen,
                        "url": None if e is None else f"http://{e.host}:{e.port}",
                        "ready": None if e is None else getattr(e, "ready", True),
                        "inflight": n, "inflight_tokens": tok, "inflight_prefill_tokens": pre,
                        "inflight_decode_tokens": dec,
                        "engine": None if ts == 0 else {"waiting": w, "running": r,
                                                        "kv_usage": k, "scraped_at": ts}})
        return {"version": None if self.table is None else self.table.version,
                "workers": [{"worker": i, "synced": o.synced, "backlog": len(o.queue)}
                            for i, o in enumerate(self.out)],
                "endpoints": out}


_ENGINE_NAMES = {
    "vllm:num_requests_waiting": 0, "sglang:num_queue_reqs": 0,
    "vllm:num_requests_running": 1, "sglang:num_running_reqs": 1,
    "vllm:kv_cache_usage_perc": 2, "vllm:gpu_cache_usage_perc": 2, "sglang:token_usage": 2,
}


def parse_engine_metrics(text: str) -> tuple[float, float, float]:
    """(waiting, running, KV usage) from an engine's Prometheus text (summed over label
    sets; KV usage averaged)."""
    vals = [0.0, 0.0, 0.0]
    n_kv = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        col = _ENGINE_NAMES.get(name)
        if col is None:
            continue
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        vals[col] += v
        n_kv += col == 2
    if n_kv > 1:
        vals[2] /= n_kv
    return vals[0], vals[1], vals[2]


async def _management(feed: Feed, host: str, port: int) -> Any:
    from motor.coordinator.supervisor import render_metrics
    from motor.http.server import HttpServer, Router
    r = Router()

    async def liveness(req: Any, resp: Any) -> None:
        resp.send(200, b'{"status":"ok"}')

    async def readiness(req: Any, resp: Any) -> None:
        synced = [o.synced and not o.queue for o in feed.out]
        ready = [k for k, e in feed.endpoints.items() if getattr(e, "ready", True)]
        ok = all(synced) and bool(ready)
        resp.send(200 if ok else 503, orjson.dumps(
            {"status": "ready" if ok else "not ready", "workers_synced": synced,
             "routable_endpoints": len(ready)}))

    async def instances(req: Any, resp: Any) -> None:
        resp.send(200, orjson.dumps(feed.instances()))

    async def metrics(req: Any, resp: Any) -> None:
        resp.send(200, render_metrics(), content_type=b"text/plain; version=0.0.4; charset=utf-8")

    r.get("/liveness")(liveness)
    r.get("/health")(liveness)
    r.get("/readiness")(readiness)
    r.get("/instances")(instances)
    r.get("/metrics")(metrics)
    server = HttpServer(r)
    await server.listen(host, port)
    return server


def feed_main(cfg_json: str, prefix: str, n_workers: int, load_name: str,
              static_keys: list[tuple[str, str | None, str]] | None,
              controller_url: str | None, log_level: str) -> None:  # pragma: no cover - child
    """Entry point of the feed process."""
    import signal

    from motor.http.server import install_uvloop
    from motor.logs import setup_logging
    setup_logging(log_level)
    cfg = ClusterConfig.model_validate_json(cfg_json)
    install_uvloop()

    async def main() -> None:
        load = LoadTable.attach(load_name)
        rings = [(Ring.attach(w), Ring.attach(h))
                 for w, h in (ring_names(prefix, i) for i in range(n_workers))]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        feed = Feed(cfg, load, rings, static_keys, controller_url)
        mgmt = None
        c = cfg.coordinator
        if c.management_port is not None:
            mgmt = await _management(feed, c.host, c.management_port)
        logger.info("coordinator feed started (pid %d, %d worker ring(s))", os.getpid(),
                    n_workers)
        try:
            await feed.run(stop)
        finally:
            if mgmt is not None:
                await mgmt.shutdown(1.0)
            for w, h in rings:
                w.close()
                h.close()
            load.close()
    asyncio.run(main())


# =============================================================================
# worker side
# =============================================================================
class WorkerLink:
    """A worker's end of its two rings: applies the feed's records to the worker's
    :class:`~motor.coordinator.endpoints.EndpointTable`, its KV router (if any) and its
    load-table cells; sends routing hints.

    ``synced`` is set once a snapshot for this worker's latest ``HELLO`` is applied
    (the worker listens only then).
    """

    def __init__(self, worker: int, load: LoadTable, ring: Ring, back: Ring,
                 table: EndpointTable, router: KvRouter | None = None,
                 static: bool = False) -> None:
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
        if router is not None:
            self._wrap_router(router)

    def _wrap_router(self, router: KvRouter) -> None:
        """Approximate-mode insertions of this worker go to the feed, which forwards them."""
        local = router.routed

        def routed(ep: Any, group: str | None, hashes: Any) -> None:
            local(ep, group, hashes)
            cell = ep.shared
            if cell is None or hashes is None or not len(hashes) \
                    or not router.uses_approximate(ep, group):
                return
            g = (group or "").encode()
            if not self.back.try_push(HINT, _HINT.pack(cell.slot, len(g)) + g
                                      + np.ascontiguousarray(hashes, np.uint64).tobytes()):
                self.hints_dropped += 1
        router.routed = routed  # type: ignore[method-assign]

    def hello(self) -> None:
        """Ask the feed for a snapshot (start, or records lost)."""
        self.nonce = int.from_bytes(os.urandom(8), "little") >> 1
        self._waiting_nonce = True
        while not self.back.try_push(HELLO, _NONCE.pack(self.nonce)):
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
            (nonce,) = _NONCE.unpack(p)
            self._waiting_nonce = nonce != self.nonce
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
            ev = {r.slot(k) for k in msg["events"] if k in self.table.endpoints}
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
        return self.router.slot(key)

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
        fslot, glen = _HINT.unpack_from(p)
        s = self._local_slot(fslot)
        if s is None:
            return
        group = p[_HINT.size:_HINT.size + glen].decode() or None
        hashes = np.frombuffer(p, np.uint64, offset=_HINT.size + glen)
        r._approx(group).insert(s, hashes, r.clock())

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
    "Feed",
    "FeedKv",
    "RecordingIndex",
    "WorkerLink",
    "decode_ops",
    "encode_op",
    "feed_main",
    "parse_engine_metrics",
    "ring_names",
]
