"""ZMQ subscriptions: connect / bind direction, gap -> replay or purge, restart, table sync."""
from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from motor._fast.hashing import block_hashes
from motor.coordinator import metrics
from motor.coordinator.kv import KvRouter
from motor.coordinator.kv.subscriber import KvEventFeed, KvEventSubscriber
from motor.protocol.kv_events import KvEventsAddress
from tests.support.gateway import run_async
from tests.support.procs import free_ports

BS = 16
TOKS = list(range(1000, 1064))


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def payload(*events: dict) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


class Pub:
    """A vLLM-like publisher on a plain PUB socket (binds, or connects to a binding SUB)."""

    def __init__(self, ctx: zmq.Context, endpoint: str | None = None) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint:
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, body: bytes, seq: int | None = None) -> None:
        if seq is None:
            seq = self.seq
        self.seq = seq + 1
        self.sock.send_multipart([b"kv", seq.to_bytes(8, "big"), body])


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def joined(pub: Pub, sub: KvEventSubscriber) -> None:
    """Slow joiner: publish empty batches until one arrives."""
    st = sub.router.ingest.slots[sub.slot]
    deadline = time.monotonic() + 10
    while st.last_seq < 0:
        assert time.monotonic() < deadline
        pub.send(payload())
        await asyncio.sleep(0.02)
    await until(lambda: st.last_seq == pub.seq - 1)


def cached(router: KvRouter, key: str) -> int:
    h = block_hashes(np.asarray(TOKS, np.uint32), BS)
    return int(router.match(h, None)[router.slot(key)].sum())


def gaps(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("motor_coordinator_kv_event_gaps_total",
                                             {"outcome": outcome}) or 0.0


@run_async
async def test_gap_without_replay_purges_the_instance() -> None:
    zctx, actx, router = zmq.Context(), zmq.asyncio.Context(), KvRouter()
    pub = Pub(zctx)
    sub = KvEventSubscriber(router, "a#0", KvEventsAddress(pub.endpoint), actx)
    task = asyncio.ensure_future(sub.run())
    try:
        await joined(pub, sub)
        pub.send(payload(stored([1, 2, 3, 4], None, TOKS)))
        await until(lambda: cached(router, "a#0") == 4)
        before = gaps("purged")
        pub.send(payload(), seq=pub.seq + 3)  # three batches lost
        await until(lambda: gaps("purged") == before + 1)
        assert cached(router, "a#0") == 0 and router.exact.n_blocks == 0
        pub.send(payload(stored([1, 2], None, TOKS[:32])))  # the stream goes on afterwards
        await until(lambda: cached(router, "a#0") == 2)
    finally:
        task.cancel()
        sub.close()
        pub.sock.close()
        zctx.term()
        actx.term()


@run_async
async def test_gap_is_filled_from_the_replay_socket() -> None:
    zctx, actx, router = zmq.Context(), zmq.asyncio.Context(), KvRouter()
    pub = Pub(zctx)
    rtr = actx.socket(zmq.ROUTER)
    rtr.setsockopt(zmq.LINGER, 0)
    rport = rtr.bind_to_random_port("tcp://127.0.0.1")
    buffered: dict[int, bytes] = {}

    async def serve_replay() -> None:
        while True:
            ident, empty, start8 = await rtr.recv_multipart()
            start = int.from_bytes(start8, "big")
            for seq in sorted(s for s in buffered if s >= start):
                await rtr.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), buffered[seq]])
            await rtr.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    rtask = asyncio.ensure_future(serve_replay())
    sub = KvEventSubscriber(router, "a#0",
                            KvEventsAddress(pub.endpoint, replay=f"tcp://127.0.0.1:{rport}"), actx)
    task = asyncio.ensure_future(sub.run())
    try:
        await joined(pub, sub)
        before = gaps("replayed")
        lost = pub.seq
        buffered[lost] = payload(stored([1, 2], None, TOKS[:32]))       # never reaches SUB
        buffered[lost + 1] = payload(stored([3, 4], 2, TOKS[32:]))
        pub.send(payload(), seq=lost + 2)
        await until(lambda: gaps("replayed") == before + 1)
        assert cached(router, "a#0") == 4
    finally:
        task.cancel()
        rtask.cancel()
        sub.close()
        rtr.close()
        pub.sock.close()
        zctx.term()
        actx.term()


@run_async
async def test_bind_form_for_a_connecting_publisher_and_restart_purges() -> None:
    zctx, actx, router = zmq.Context(), zmq.asyncio.Context(), KvRouter()
    port, = free_ports(1)
    addr = KvEventsAddress.parse(f"bind:tcp://127.0.0.1:{port}")
    sub = KvEventSubscriber(router, "a#0", addr, actx)  # binds, like a gateway behind vLLM
    pub = Pub(zctx, f"tcp://127.0.0.1:{port}")           # vLLM with an explicit host connects
    task = asyncio.ensure_future(sub.run())
    try:
        await joined(pub, sub)
        pub.send(payload(stored([1, 2, 3, 4], None, TOKS)))
        await until(lambda: cached(router, "a#0") == 4)
        pub.send(payload(stored([9], None, TOKS[:16])), seq=0)  # engine restarted: seq from 0
        await until(lambda: router.exact.n_blocks == 1)
        assert cached(router, "a#0") == 1
    finally:
        task.cancel()
        sub.close()
        pub.sock.close()
        zctx.term()
        actx.term()


class _Ep:
    def __init__(self, key: str, kv_events: str | None) -> None:
        self.key, self.kv_events, self.dp_rank = key, kv_events, 0


class _Table:
    def __init__(self) -> None:
        self.endpoints: dict[str, _Ep] = {}
        self.changed = asyncio.Event()


@run_async
async def test_feed_follows_the_table_and_purges_removed_instances() -> None:
    zctx, router = zmq.Context(), KvRouter()
    pub = Pub(zctx)
    table = _Table()
    feed = KvEventFeed(router, table)  # type: ignore[arg-type]
    table.endpoints["a#0"] = _Ep("a#0", pub.endpoint)
    table.endpoints["b#0"] = _Ep("b#0", None)  # no publisher: approximate mode's business
    feed.sync()
    try:
        sub, _ = feed.subs["a#0"]
        assert set(feed.subs) == {"a#0"}
        await joined(pub, sub)
        pub.send(payload(stored([1, 2, 3, 4], None, TOKS)))
        await until(lambda: cached(router, "a#0") == 4)
        del table.endpoints["a#0"]
        feed.sync()
        assert feed.subs == {} and router.exact.n_blocks == 0 and "a#0" not in router.slots()
    finally:
        feed.close()
        pub.sock.close()
        zctx.term()
