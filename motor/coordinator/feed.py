"""The feed process of a multi-worker coordinator.

One feed process (started by :mod:`motor.coordinator.supervisor`) is the only subscriber
to the controller's instance table, to the engines' KV events and to their ``/metrics``;
it is the one authority on instance slots of the load table
(:mod:`motor.coordinator.loadtable`). It writes ordered records into one SPSC ring per
worker and reads each worker's ring back to it; the records, and the workers' end of the
rings (:class:`~motor.coordinator.rings.WorkerLink`), are in
:mod:`motor.coordinator.rings`.

Nothing is silently lost: the feed keeps an outbox per worker and moves records into the
ring with ``try_push`` as space frees up. A worker that falls behind by more than
``coordinator.feed.max_backlog_records`` (or a dead worker) gets its outbox dropped and
a fresh snapshot queued instead (metric-free log line ``worker i fell behind``). A worker
that sees a ring overflow record (never produced by this feed, kept as a safety net)
asks for a snapshot. A restarted worker sends ``HELLO`` and accepts no request before
its ``SNAP_END``.

Models (controller mode): the feed reads each ready endpoint's ``/v1/models`` as it
appears and every ``coordinator.health_check_interval_s``
(:class:`~motor.coordinator.endpoints.ModelReader`) and sends what the engines list (model
ids, LoRA adapters included, and ``max_model_len``) to the workers in its ``TABLE`` record,
so that every worker routes adapters loaded at run time and bounds failover continuations
as a one-process coordinator does. (Standalone workers read their backends' lists
themselves, with their health probes.)

HTTPS endpoints (``Endpoint.scheme`` ``https``, ``https://`` backends): the scrape and the
model reads speak TLS to them with ``coordinator.upstream_tls``'s context; each worker
verifies a handshake itself before it routes there (:class:`~motor.coordinator.endpoints.
EndpointTable`).

Engine figures: every ``coordinator.feed.scrape_interval_s`` the feed reads each ready
endpoint's ``/metrics`` (:func:`motor.protocol.engine_metrics.parse_engine_metrics`:
waiting and running requests, KV cache usage of vLLM and SGLang) into the load table's
engine figures.

Management API (``coordinator.management_port``, served by the feed): ``/liveness``,
``/readiness`` (:mod:`motor.coordinator.probes`: ready when every worker is synced with
no backlog and some endpoint is ready; both bodies add ``workers_synced``, one boolean
per worker), ``/instances`` (the table
with slots, the load summed over workers and the engine figures) and ``/metrics``
(prometheus multiprocess aggregation over all workers and the feed).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson

from motor._fast.ring import RECORD_OVERFLOW, Ring
from motor.aio import cancel_and_wait
from motor.config.schema import ClusterConfig
from motor.coordinator.loadtable import LoadTable
from motor.coordinator.rings import (
    HELLO,
    HINT,
    KV,
    OP_CLEAR,
    SESSION,
    OP_HEADER_BYTES,
    OP_REMOVE,
    OP_STORE,
    SNAP_BEGIN,
    SNAP_END,
    TABLE,
    decode_nonce,
    encode_nonce,
    encode_op,
    ring_names,
)
from motor.protocol.engine_metrics import parse_engine_metrics
from motor.protocol.instances import InstanceState, InstanceTable

logger = logging.getLogger(__name__)


class RecordingIndex:
    """What :class:`~motor.coordinator.kv.ingest.KvIngest` writes to in the feed: instead
    of a radix tree, each operation is encoded for the workers (and kept, one dict entry
    per held block, so that a snapshot can replay the current holdings)."""

    def __init__(self, on_ops: Any, max_payload: int = 1 << 20) -> None:
        self.on_ops = on_ops
        self.max_payload = max_payload
        # hashes per op so that one op always fits a record
        self.max_hashes = max(1, (max_payload - OP_HEADER_BYTES) // 8)
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
        self.controller_url = controller_url or ",".join(cfg.controller.urls)
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
        self.kv.index.max_hashes = max(1, (self.kv.index.max_payload - OP_HEADER_BYTES) // 8)
        self.kv_feed: Any = None
        self._flush_scheduled = False
        self.wake = asyncio.Event()
        self.max_backlog = cfg.coordinator.feed.max_backlog_records
        self.synced_table = asyncio.Event()
        #: endpoint key -> ((host, port) read, {"ids": [...], "max_model_len": n}): what its
        #: engine's /v1/models listed (controller mode), sent to the workers in TABLE
        self.models: dict[str, tuple[tuple[str, int], dict[str, Any]]] = {}
        #: model ids known to be LoRA adapters (never forgotten, as in one process)
        self.adapters: set[str] = set()
        self.model_reader: Any = None
        self._table_scheduled = False
        self._engine_tls: Any = None

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
        for key in [k for k, (addr, _) in self.models.items()
                    if k not in self.endpoints
                    or (self.endpoints[k].host, self.endpoints[k].port) != addr]:
            del self.models[key]   # gone or moved: its engine's list is read again
        if self.kv_feed is not None:
            self.kv_feed.sync()
        self.flush_kv()
        self.broadcast(TABLE, self._table_payload())
        self.synced_table.set()

    def _table_payload(self) -> bytes:
        ev_keys = [k for k, (s, _) in self.slots.items() if s in self.kv.event_slots]
        return orjson.dumps({
            "table": None if self.table is None else self.table.model_dump(mode="json"),
            "slots": self.slots, "events": ev_keys,
            "models": {k: info for k, (_, info) in self.models.items()},
            "adapters": sorted(self.adapters)})

    def on_models(self, ep: SimpleNamespace, m: Any) -> None:
        """``ep``'s engine listed ``m`` (:class:`~motor.coordinator.endpoints.Models`): a
        change goes to the workers in the next ``TABLE`` record."""
        cur = self.endpoints.get(ep.key)
        if cur is None or (cur.host, cur.port) != (ep.host, ep.port):
            return      # gone or moved since the read began
        info = {"ids": sorted(m.ids), "max_model_len": m.max_model_len}
        old = self.models.get(ep.key)
        if old is not None and old[1] == info and m.adapters <= self.adapters:
            return
        self.models[ep.key] = ((ep.host, ep.port), info)
        self.adapters |= m.adapters
        if not self._table_scheduled:
            self._table_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_table)

    def _send_table(self) -> None:
        self._table_scheduled = False
        self.broadcast(TABLE, self._table_payload())

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
        q.append((SNAP_BEGIN, encode_nonce(nonce)))
        if self.synced_table.is_set():
            q.append((TABLE, self._table_payload()))
        for p in self.kv.index.snapshot():
            q.append((KV, p))
        q.append((SNAP_END, encode_nonce(nonce)))
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
                        logger.info("worker %d asks for a snapshot", i)
                        self.snapshot(i, decode_nonce(p))
                    elif t == HINT or t == SESSION:
                        self.broadcast(t, p, skip=i)
                    elif t == RECORD_OVERFLOW:
                        logger.warning("worker %d: hints dropped (its ring to the feed was "
                                       "full)", i)
            if any(o.queue for o in self.out):
                self.drain()
            idle = 0 if busy else idle + 1
            await asyncio.sleep(0.001 if idle < 100 else 0.005)

    # -- sources ------------------------------------------------------------------
    async def follow_controller(self) -> None:
        """Long-poll the controller (:func:`motor.coordinator.controller_poll.follow_controller`)
        into :meth:`apply_table`; the workers keep the last table while it is away."""
        from motor.coordinator.controller_poll import controller_client, follow_controller
        # mTLS to the controller with controller.tls (an https:// URL)
        link = controller_client(self.controller_url, self.cfg.controller.tls, 2, 2.0)
        try:
            await follow_controller(link, self.apply_table, who="feed: ")
        finally:
            link.client.close()

    def apply_table(self, table: InstanceTable) -> None:
        """A new instance table: its endpoints (instances not ``removed``; ready while
        their instance is ``ready``) become the feed's (:meth:`set_endpoints`)."""
        self.table = table
        eps = {}
        for inst in table.instances:
            if inst.state in (InstanceState.REMOVED, InstanceState.STOPPED):
                continue   # a stopped engine restarts empty: its slot and cache go too
            for spec in inst.endpoints:
                key = f"{inst.id}#{spec.dp_rank}"
                eps[key] = SimpleNamespace(
                    key=key, kv_events=inst.kv_events, dp_rank=spec.dp_rank,
                    host=spec.host, port=spec.port, https=spec.https, scheme=spec.scheme,
                    ready=inst.state == InstanceState.READY)
        self.set_endpoints(eps)
        if self.model_reader is not None:
            self.model_reader.added()

    def engine_tls(self) -> Any:
        """The engines' client context (``coordinator.upstream_tls``), made once; the
        scrape and the model reads speak HTTPS with it to endpoints marked ``https``."""
        if self._engine_tls is None:
            from motor.http.tls import client_context
            u = self.cfg.coordinator.upstream_tls
            self._engine_tls = client_context(u.ca_file, u.verify, u.cert_file, u.key_file,
                                              u.key_password_file)
        return self._engine_tls

    async def scrape(self) -> None:
        from motor.http.client import Client
        interval = self.cfg.coordinator.feed.scrape_interval_s
        client = Client(max_connections_per_endpoint=1, connect_timeout_s=1.0,
                        tls=self.engine_tls())
        try:
            while True:
                await asyncio.sleep(interval)
                eps = [(k, e) for k, e in self.endpoints.items() if getattr(e, "ready", True)]
                await asyncio.gather(*(self._scrape_one(client, k, e) for k, e in eps))
        finally:
            client.close()

    async def _scrape_one(self, client: Any, key: str, ep: SimpleNamespace) -> None:
        try:
            client.use_tls(ep.host, ep.port, getattr(ep, "https", False))
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
                                                   port=int(url.rsplit(":", 1)[1]),
                                                   https=url.startswith("https://"),
                                                   scheme=url.split(":", 1)[0])
                                for k, ev, url in self.static_keys})
        else:
            from motor.coordinator.endpoints import ModelReader
            from motor.http.client import Client
            models_client = Client(max_connections_per_endpoint=1,
                                   connect_timeout_s=c.health_check_timeout_s,
                                   tls=self.engine_tls())
            self.model_reader = ModelReader(models_client, lambda: self.endpoints.values(),
                                            self.on_models, c.health_check_interval_s,
                                            c.health_check_timeout_s)
            tasks.append(asyncio.ensure_future(self.model_reader.run()))
            tasks.append(asyncio.ensure_future(self.follow_controller()))
        if c.feed.scrape_interval_s > 0:
            tasks.append(asyncio.ensure_future(self.scrape()))
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(*tasks)
            if self.kv_feed is not None:
                self.kv_feed.close()
            if self.model_reader is not None:
                self.model_reader.close()
                self.model_reader.client.close()

    # -- management API -------------------------------------------------------------
    def instances(self) -> dict[str, Any]:
        """The endpoints with slots, load and engine figures; ``kv_blocks``: (tier, block)
        holdings of the endpoint from its KV events (how hot its cache is, for ``motor ctl
        restart --rolling``), null without KV events."""
        out = []
        held = self.kv.index.held
        for key, (slot, gen) in sorted(self.slots.items()):
            n, tok, pre, dec = self.load.totals(slot, gen)
            w, r, k, ts = self.load.read_engine(slot)
            e = self.endpoints.get(key)
            out.append({"key": key, "slot": slot, "generation": gen,
                        "instance": key.rpartition("#")[0],
                        "kv_blocks": None if self.kv_feed is None else
                        sum(len(held.get((slot, t), ())) for t in range(3)),
                        "url": None if e is None else
                        f"{getattr(e, 'scheme', 'http')}://{e.host}:{e.port}",
                        "ready": None if e is None else getattr(e, "ready", True),
                        "inflight": n, "inflight_tokens": tok, "inflight_prefill_tokens": pre,
                        "inflight_decode_tokens": dec,
                        "engine": None if ts == 0 else {"waiting": w, "running": r,
                                                        "kv_usage": k, "scraped_at": ts}})
        return {"version": None if self.table is None else self.table.version,
                "workers": [{"worker": i, "synced": o.synced, "backlog": len(o.queue)}
                            for i, o in enumerate(self.out)],
                "endpoints": out}


async def _management(feed: Feed, host: str, port: int) -> Any:
    from motor.coordinator import probes
    from motor.coordinator.metrics import CONTENT_TYPE, render_metrics
    from motor.http.server import HttpServer, Router
    r = Router()

    async def readiness(req: Any, resp: Any) -> None:
        synced = [o.synced and not o.queue for o in feed.out]
        ready = [k for k, e in feed.endpoints.items() if getattr(e, "ready", True)]
        probes.readiness(resp, len(ready), all(synced), workers_synced=synced)

    async def instances(req: Any, resp: Any) -> None:
        resp.send(200, orjson.dumps(feed.instances()))

    async def metrics(req: Any, resp: Any) -> None:
        resp.send(200, render_metrics(), content_type=CONTENT_TYPE)

    async def cluster(req: Any, resp: Any) -> None:
        from motor.coordinator import page
        resp.send(200, page.PAGE_BYTES, content_type=page.CONTENT_TYPE)

    r.get("/liveness")(probes.health)
    r.get("/health")(probes.health)
    r.get("/readiness")(readiness)
    r.get("/instances")(instances)
    r.get("/metrics")(metrics)
    r.get("/cluster")(cluster)
    server = HttpServer(r)
    await server.listen(host, port)
    return server


def feed_main(cfg_json: str, prefix: str, n_workers: int, load_name: str,
              static_keys: list[tuple[str, str | None, str]] | None,
              controller_url: str | None, log_level: str) -> None:  # pragma: no cover - child
    """Entry point of the feed process."""
    import signal

    from motor.coordinator import mpvalues
    from motor.http.server import install_uvloop
    from motor.logs import setup_logging
    mpvalues.install()   # before the first metric is made
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


__all__ = [
    "Feed",
    "FeedKv",
    "RecordingIndex",
    "feed_main",
]
