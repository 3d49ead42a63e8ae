"""ZMQ subscriptions to the engines' KV-event publishers (the socket loops).

One :class:`KvEventSubscriber` per endpoint with a ``kv_events`` address
(:class:`~motor.protocol.kv_events.KvEventsAddress`): a SUB socket that connects to a
binding publisher (``motor sim``, vLLM ``tcp://*:P`` / ipc, SGLang) or binds the
address a connecting publisher dials (``bind:`` form: vLLM with an explicit host).
Every message goes through :class:`~motor.coordinator.kv.ingest.KvIngest`; the
sequence check decides:

* next seq: apply;
* a gap: with a replay endpoint, a DEALER asks for ``[b"", start_seq]`` and applies
  what comes back until the end marker (``events.replay_timeout_s``); whatever is still
  missing (or no replay endpoint) -> the instance's blocks are purged (metric
  ``motor_coordinator_kv_event_gaps_total{outcome="purged"}`` and a warning), then the
  new batch applies;
* seq 0 after a higher one: the engine restarted, its cache is empty: purge;
* an old seq (replay overlap): skipped.

:class:`KvEventFeed` keeps one subscriber per endpoint of the
:class:`~motor.coordinator.endpoints.EndpointTable`, and purges and frees the slot of
every endpoint that left the table.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from motor.coordinator import metrics
from motor.coordinator.kv.ingest import SeqCheck
from motor.errors import WireError
from motor.protocol.kv_events import KvEventsAddress, decode_batch, split_message, split_replay

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointTable
    from motor.coordinator.kv.router import KvRouter

logger = logging.getLogger(__name__)


class KvEventSubscriber:
    """The SUB socket of one endpoint, feeding ``router.ingest``."""

    def __init__(self, router: KvRouter, key: str, address: KvEventsAddress,
                 ctx: zmq.asyncio.Context, replay_timeout_s: float = 1.0) -> None:
        self.router = router
        self.key = key
        self.address = address
        self.slot = router.slot(key)
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if address.bind:
            self.sock.bind(address.endpoint)
        else:
            self.sock.connect(address.endpoint)
        self.batches = 0
        self.gaps = 0
        router.event_slots.add(self.slot)

    async def run(self) -> None:
        ingest = self.router.ingest
        while True:
            frames = await self.sock.recv_multipart()
            try:
                _, seq, payload = split_message(frames)
            except WireError as e:
                metrics.KV_EVENTS_DROPPED.labels("malformed").inc()
                logger.warning("KV events of %s: %s", self.key, e)
                continue
            check = ingest.check_seq(self.slot, seq)
            st = ingest.slots[self.slot]
            if check is SeqCheck.OK and st.last_seq < 0 and seq > 0 and self.address.replay:
                check = SeqCheck.GAP  # joined late: fetch what the engine still buffers
            if check is SeqCheck.DUPLICATE:
                metrics.KV_EVENTS_DROPPED.labels("duplicate").inc()
                continue
            if check is SeqCheck.RESTART:
                n = self.router.purge(self.key, "restart")
                logger.warning("KV events of %s restarted at seq 0 (engine restart): %d block "
                               "holding(s) purged", self.key, n)
            elif check is SeqCheck.GAP:
                await self._gap(st.last_seq + 1, seq)
            self._apply(seq, payload, "live")

    def _apply(self, seq: int, payload: bytes, source: str) -> None:
        try:
            batch = decode_batch(payload)
        except WireError as e:
            metrics.KV_EVENTS_DROPPED.labels("malformed").inc()
            logger.warning("KV events of %s: batch %d dropped: %s", self.key, seq, e)
            self.router.ingest.slots[self.slot].last_seq = seq
            return
        self.router.ingest.apply(self.slot, seq, batch, self.router.clock())
        self.batches += 1
        metrics.KV_EVENT_BATCHES.labels(source).inc()
        metrics.KV_EVENT_LAG.observe(max(0.0, time.time() - batch.ts))
        self.router.update_gauges()

    async def _gap(self, start: int, stop: int) -> None:
        """Batches ``start .. stop-1`` were lost: replay them or purge."""
        self.gaps += 1
        expected = start
        if self.address.replay:
            expected = await self._replay(start, stop)
        if expected >= stop:
            metrics.KV_EVENT_GAPS.labels("replayed").inc()
            logger.info("KV events of %s: gap %d..%d replayed", self.key, start, stop - 1)
            return
        metrics.KV_EVENT_GAPS.labels("purged").inc()
        n = self.router.purge(self.key, "gap")
        logger.warning("KV events of %s: batches %d..%d lost (%s); %d block holding(s) purged",
                       self.key, expected, stop - 1,
                       "replay incomplete" if self.address.replay else "no replay endpoint", n)

    async def _replay(self, start: int, stop: int) -> int:
        """Ask the replay socket for seq >= start; apply start..stop-1; return the next missing."""
        assert self.address.replay is not None
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        expected = start
        try:
            d.connect(self.address.replay)
            await d.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await d.poll(int(left * 1000) + 1):
                    logger.warning("KV events of %s: replay from %s timed out after %.1f s",
                                   self.key, self.address.replay, self.replay_timeout_s)
                    break
                try:
                    seq, payload = split_replay(await d.recv_multipart())
                except WireError as e:
                    logger.warning("KV events of %s: replay reply dropped: %s", self.key, e)
                    continue
                if seq < 0:
                    break
                if seq == expected and seq < stop:
                    self._apply(seq, payload, "replay")
                    expected += 1
        finally:
            d.close()
        return expected

    def close(self) -> None:
        self.sock.close()
        self.router.event_slots.discard(self.slot)


class KvEventFeed:
    """One subscriber per endpoint of ``table`` that has a ``kv_events`` address."""

    def __init__(self, router: KvRouter, table: EndpointTable) -> None:
        self.router = router
        self.table = table
        self.ctx = zmq.asyncio.Context()
        self.subs: dict[str, tuple[KvEventSubscriber, asyncio.Task[None]]] = {}
        self.enabled = router.cfg.events.enabled

    def sync(self) -> None:
        """Match subscriptions and slots to the table (start new ones, drop gone ones)."""
        eps = self.table.endpoints
        for key in [k for k in self.subs if k not in eps or
                    str(self._address(eps[k])) != str(self.subs[k][0].address)]:
            sub, task = self.subs.pop(key)
            task.cancel()
            sub.close()
        self.router.sync(eps.keys())
        if self.enabled:
            for key, ep in eps.items():
                if key in self.subs or not ep.kv_events:
                    continue
                addr = self._address(ep)
                if addr is None:
                    continue
                try:
                    sub = KvEventSubscriber(self.router, key, addr, self.ctx,
                                            self.router.cfg.events.replay_timeout_s)
                except (zmq.ZMQError, RuntimeError) as e:
                    logger.warning("KV events of %s: cannot subscribe to %s: %s", key, addr, e)
                    continue
                task = asyncio.ensure_future(self._guard(sub))
                self.subs[key] = (sub, task)
                logger.info("KV events of %s: %s %s", key,
                            "bound" if addr.bind else "connected to", addr)
        metrics.KV_SUBSCRIPTIONS.set(len(self.subs))

    def _address(self, ep: object) -> KvEventsAddress | None:
        text = getattr(ep, "kv_events", None)
        if not text:
            return None
        try:
            return KvEventsAddress.parse(text).for_dp_rank(getattr(ep, "dp_rank", 0))
        except ValueError as e:
            logger.warning("KV events of %s: %s", getattr(ep, "key", "?"), e)
            return None

    async def _guard(self, sub: KvEventSubscriber) -> None:
        try:
            await sub.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug in one feed must not stop routing
            logger.exception("KV events of %s: subscriber failed; its blocks are purged", sub.key)
            self.router.purge(sub.key, "error")

    async def run(self) -> None:
        while True:
            changed = self.table.changed
            self.sync()
            await changed.wait()

    def close(self) -> None:
        for sub, task in self.subs.values():
            task.cancel()
            sub.close()
        self.subs.clear()
        self.ctx.term()
