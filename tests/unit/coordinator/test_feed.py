"""The feed and the workers' ends of the rings, in one process: snapshots, KV index
operations re-hashed in the feed, slot recycling, a worker that fell behind, hints."""
from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest

from motor._fast.hashing import block_hashes
from motor._fast.ring import Ring
from motor.config.schema import ClusterConfig, Role
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.feed import Feed
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.loadtable import LoadTable
from motor.coordinator.rings import WorkerLink, ring_names
from motor.http.client import Client
from motor.protocol.engine_metrics import parse_engine_metrics
from motor.protocol.kv_events import BlockRemoved, BlockStored, EventBatch

BS = 16
TOKENS = list(range(1, 4 * BS + 1))


class Rig:
    """A feed with two workers (standalone backends, kv_affinity without subscriptions)."""

    def __init__(self, ring_bytes: int = 1 << 20, max_backlog: int = 10000) -> None:
        self.cfg = ClusterConfig.model_validate({"coordinator": {
            "policy": "kv_affinity", "kv": {"block_size": BS, "events": {"enabled": False}},
            "feed": {"scrape_interval_s": 0, "max_backlog_records": max_backlog}}})
        self.prefix = f"motor-test-feed-{uuid.uuid4().hex[:10]}"
        self.load = LoadTable.create(f"{self.prefix}-load", 2, 16)
        self.rings = []
        for i in range(2):
            w, h = ring_names(self.prefix, i)
            self.rings.append((Ring.create(w, ring_bytes), Ring.create(h, 1 << 16)))
        keys = [(f"backend-{i}#0", None, f"http://127.0.0.1:{9 + i}") for i in range(2)]
        self.feed = Feed(self.cfg, self.load, self.rings, keys)
        self.client = Client()
        self.tables, self.routers, self.links = [], [], []
        for i in range(2):
            t = EndpointTable(self.client)
            t.set_static([(Role.UNION, "127.0.0.1", 9), (Role.UNION, "127.0.0.1", 10)])
            r = KvRouter(self.cfg.coordinator.kv)
            w, h = ring_names(self.prefix, i)
            link = WorkerLink(i, LoadTable.attach(self.load.name), Ring.attach(w), Ring.attach(h),
                              t, r, static=True)
            self.tables.append(t)
            self.routers.append(r)
            self.links.append(link)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, workers: tuple[int, ...] = (0, 1)) -> None:
        self.tasks.append(asyncio.ensure_future(self.feed.run(self.stop)))
        for i in workers:
            self.tasks.append(asyncio.ensure_future(self.links[i].run()))
        await asyncio.wait_for(asyncio.gather(*(self.links[i].synced.wait() for i in workers)), 5)

    async def close(self) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for link in self.links:
            link.close()
            link.load.close()
        for w, h in self.rings:
            for r in (w, h):
                r.close()
                r.unlink()
        self.client.close()
        self.load.close()
        self.load.unlink()

    def store(self, key: str, tokens: list[int], seq: int) -> None:
        slot = self.feed.kv.slot(key)
        self.feed.kv.ingest.apply(slot, seq, EventBatch(time.time(), [BlockStored(
            [f"e{seq}-{j}".encode() for j in range(len(tokens) // BS)], None, tokens, BS)], 0))

    def overlap(self, worker: int, key: str, tokens: list[int]) -> int:
        r = self.routers[worker]
        ov = r.match(block_hashes(np.asarray(tokens, np.uint32), BS), None)
        return int(ov[r.slot(key)].sum())


async def until(cond, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)
    return time.monotonic() - t0


def test_snapshot_slots_and_kv_events_reach_every_worker():
    async def main() -> None:
        rig = Rig()
        try:
            await rig.start()
            for t in rig.tables:   # every endpoint has a cell at the feed's slot
                for key, ep in t.endpoints.items():
                    assert (ep.shared.slot, ep.shared.gen) == rig.feed.slots[key]
            rig.store("backend-1#0", TOKENS, 0)
            await until(lambda: all(rig.overlap(w, "backend-1#0", TOKENS) == 4 for w in (0, 1)))
            assert rig.overlap(0, "backend-0#0", TOKENS) == 0
            # removal by engine hash: the feed translated it, the workers drop the blocks
            slot = rig.feed.kv.slot("backend-1#0")
            rig.feed.kv.ingest.apply(slot, 1, EventBatch(time.time(), [BlockRemoved(
                [b"e0-2", b"e0-3"])], 0))
            await until(lambda: rig.overlap(1, "backend-1#0", TOKENS) == 2
                        and rig.overlap(0, "backend-1#0", TOKENS) == 2)
            # load in one worker's row is seen by the other worker's policy input
            ep0 = rig.tables[0].endpoints["backend-1#0"]
            ep1 = rig.tables[1].endpoints["backend-1#0"]
            ep0.acquire(100, 40, 60)
            assert ep1.shared.totals() == (1, 100, 40, 60)
            ep0.release(100, 40, 60)
            assert ep1.shared.totals() == (0, 0, 0, 0)
        finally:
            await rig.close()
    asyncio.run(main())


def test_removed_endpoint_retires_its_slot_and_workers_rebind():
    async def main() -> None:
        rig = Rig()
        try:
            await rig.start()
            ep = rig.tables[0].endpoints["backend-0#0"]
            ep.acquire(10, 5, 5)                 # in flight while the slot changes
            old = rig.feed.slots["backend-0#0"]
            eps = dict(rig.feed.endpoints)
            gone = eps.pop("backend-0#0")
            rig.feed.set_endpoints(eps)
            assert rig.load.slot_gen(old[0]) == old[1] + 1
            rig.feed.set_endpoints({**eps, "backend-0#0": gone})   # back, new generation
            new = rig.feed.slots["backend-0#0"]
            assert new != old
            await until(lambda: (ep.shared.slot, ep.shared.gen) == new)
            assert ep.shared.totals() == (1, 10, 5, 5)   # carried over to the new cell
            ep.release(10, 5, 5)
            assert ep.shared.totals() == (0, 0, 0, 0)
            assert rig.load.totals(*old) == (0, 0, 0, 0)
        finally:
            await rig.close()
    asyncio.run(main())


def test_worker_that_fell_behind_gets_a_snapshot():
    async def main() -> None:
        rig = Rig(ring_bytes=64 * 1024, max_backlog=32)
        try:
            await rig.start(workers=(0,))
            # worker 1 is not consuming: its HELLO arrives only later; meanwhile worker 0
            # consumes; then worker 1 starts, and later stalls while many batches go by
            rig.tasks.append(asyncio.ensure_future(rig.links[1].run()))
            await asyncio.wait_for(rig.links[1].synced.wait(), 5)
            stalled = rig.tasks.pop()
            stalled.cancel()
            snaps = rig.links[1].snapshots
            prompts = [[100000 * k + j for j in range(1, 64 * BS + 1)] for k in range(400)]
            for k, p in enumerate(prompts):
                rig.store("backend-0#0", p, k)
                await asyncio.sleep(0)
            assert rig.feed.out[1].queue, "worker 1's backlog is waiting"
            rig.tasks.append(asyncio.ensure_future(rig.links[1].run()))
            await until(lambda: rig.links[1].snapshots > snaps and not rig.feed.out[1].queue
                        and rig.links[1].ring.used_bytes == 0)
            for p in (prompts[0], prompts[200], prompts[-1]):
                assert rig.overlap(1, "backend-0#0", p) == 64
                assert rig.overlap(0, "backend-0#0", p) == 64
        finally:
            await rig.close()
    asyncio.run(main())


def test_approximate_hints_reach_the_other_workers():
    async def main() -> None:
        rig = Rig()
        try:
            await rig.start()
            ep = rig.tables[0].endpoints["backend-1#0"]
            hashes = block_hashes(np.asarray(TOKENS, np.uint32), BS)
            rig.routers[0].routed(ep, None, hashes)   # approximate mode: no subscriptions
            await until(lambda: rig.overlap(1, "backend-1#0", TOKENS) == 4)
            assert rig.overlap(0, "backend-1#0", TOKENS) == 4
        finally:
            await rig.close()
    asyncio.run(main())


def test_a_hint_for_an_endpoint_beyond_the_kv_slots_is_skipped():
    """A worker whose 256 KV slots are taken gets a hint (or KV operations) for an endpoint
    without one: it skips them and its link goes on (it raised and stopped reading the
    rings); once a slot is free, the next hint lands."""
    async def main() -> None:
        rig = Rig()
        try:
            await rig.start()
            r1 = rig.routers[1]
            assert "backend-1#0" not in r1.slot_map
            fillers = [f"filler-{i}" for i in range(256 - len(r1.slot_map))]
            for k in fillers:
                r1.slot(k)
            ep = rig.tables[0].endpoints["backend-1#0"]
            hashes = block_hashes(np.asarray(TOKENS, np.uint32), BS)
            rig.routers[0].routed(ep, None, hashes)
            rig.store("backend-1#0", TOKENS, 0)        # KV operations for it too
            await until(lambda: rig.overlap(0, "backend-1#0", TOKENS) == 4)
            await asyncio.sleep(0.05)                   # worker 1 polled them
            assert "backend-1#0" not in r1.slot_map
            assert not any(t.done() for t in rig.tasks)
            r1.forget(fillers[0])
            other = list(range(100, 100 + 4 * BS))
            rig.routers[0].routed(ep, None, block_hashes(np.asarray(other, np.uint32), BS))
            await until(lambda: rig.overlap(1, "backend-1#0", other) == 4)
        finally:
            await rig.close()
    asyncio.run(main())


def test_parse_engine_metrics():
    text = ("# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name=\"m\"} 3.0\n"
            "vllm:num_requests_running{model_name=\"m\"} 2\nvllm:kv_cache_usage_perc 0.5\n"
            "sglang:token_usage 0.25\nother 9\n")
    assert parse_engine_metrics(text) == (3.0, 2.0, 0.375)
    assert parse_engine_metrics("") == (0.0, 0.0, 0.0)


@pytest.fixture(autouse=True)
def _no_leftover_shm():
    import os
    before = {n for n in os.listdir("/dev/shm") if n.startswith("motor-test-feed-")}
    yield
    after = {n for n in os.listdir("/dev/shm") if n.startswith("motor-test-feed-")}
    assert after <= before


def test_engine_models_reach_the_workers_in_controller_mode():
    """What an engine lists on /v1/models (read by the feed in controller mode: ids, LoRA
    adapters, max_model_len) reaches every worker's endpoint table and adapter set, also a
    worker that joins later (snapshot); an unloaded adapter stops being served."""
    from motor.config.schema import EngineKind
    from motor.coordinator.endpoints import Models
    from motor.protocol.instances import Endpoint, Instance, InstanceState, InstanceTable

    async def main() -> None:
        cfg = ClusterConfig.model_validate({"coordinator": {"feed": {"scrape_interval_s": 0}}})
        prefix = f"motor-test-feed-{uuid.uuid4().hex[:10]}"
        load = LoadTable.create(f"{prefix}-load", 2, 16)
        rings = []
        for i in range(2):
            w, h = ring_names(prefix, i)
            rings.append((Ring.create(w, 1 << 20), Ring.create(h, 1 << 16)))
        feed = Feed(cfg, load, rings, None, "http://127.0.0.1:9")
        client = Client()
        tables = [EndpointTable(client) for _ in range(2)]
        routers = [KvRouter(cfg.coordinator.kv, adapters=t.adapters) for t in tables]
        links = []
        for i in range(2):
            w, h = ring_names(prefix, i)
            links.append(WorkerLink(i, LoadTable.attach(load.name), Ring.attach(w),
                                    Ring.attach(h), tables[i], routers[i]))
        tasks = [asyncio.ensure_future(feed.pump()), asyncio.ensure_future(links[0].run())]
        try:
            await asyncio.wait_for(links[0].synced.wait(), 5)
            feed.apply_table(InstanceTable(version=3, instances=[Instance(
                id=f"n/e/{j}", model="base", role=Role.UNION, engine=EngineKind.VLLM,
                node="n", endpoints=[Endpoint(host="127.0.0.1", port=20 + j)],
                state=InstanceState.READY) for j in range(2)]))
            await until(lambda: len(tables[0].endpoints) == 2)
            ep = feed.endpoints["n/e/0#0"]
            feed.on_models(ep, Models(frozenset({"base", "sql-lora"}), 2048,
                                      frozenset({"sql-lora"})))
            feed.on_models(feed.endpoints["n/e/1#0"], Models(frozenset({"base"}), 4096,
                                                              frozenset()))
            tasks.append(asyncio.ensure_future(links[1].run()))    # joins now: a snapshot
            await asyncio.wait_for(links[1].synced.wait(), 5)
            for t in tables:
                await until(lambda t=t: "sql-lora" in t.adapters
                            and t.endpoints["n/e/0#0"].models == {"base", "sql-lora"})
                assert t.endpoints["n/e/1#0"].models == {"base"}
                assert t.endpoints["n/e/0#0"].max_model_len == 2048
                assert t.endpoints["n/e/1#0"].max_model_len == 4096
                assert t.models() == ["base", "sql-lora"]
                assert [e.key for e in t.candidates(Role.UNION, "sql-lora")] == ["n/e/0#0"]
                assert t.context_length("base") == 2048
            feed.on_models(ep, Models(frozenset({"base"}), 2048, frozenset()))   # unloaded
            for t in tables:
                await until(lambda t=t: t.endpoints["n/e/0#0"].models == {"base"})
                assert t.candidates(Role.UNION, "sql-lora") == []
            # the controller drops n/e/0: its models are forgotten with it
            feed.apply_table(InstanceTable(version=4, instances=[Instance(
                id="n/e/1", model="base", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                endpoints=[Endpoint(host="127.0.0.1", port=21)], state=InstanceState.READY)]))
            assert set(feed.models) == {"n/e/1#0"}
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for link in links:
                link.close()
                link.load.close()
            for w, h in rings:
                for r in (w, h):
                    r.close()
                    r.unlink()
            client.close()
            load.close()
            load.unlink()
    asyncio.run(main())


def test_session_records_reach_the_other_workers():
    """A named session routed by one worker is recorded in the other workers' session
    tables (kv_affinity's on_session -> SESSION record -> the feed -> the other rings)."""
    from motor.coordinator.policy.kv_affinity import KvAffinity
    from motor.coordinator.policy.sessions import SessionTable
    from motor.coordinator.rings import decode_session, encode_session

    assert decode_session(encode_session(7, "bob")) == (7, b"bob")
    assert decode_session(encode_session(300, b"\xffraw")) == (300, b"\xffraw")

    async def main() -> None:
        rig = Rig()
        tables = [SessionTable(16), SessionTable(16)]
        for link, t in zip(rig.links, tables):
            link.sessions = t
        try:
            await rig.start()
            policy = KvAffinity(rig.routers[0])
            policy.sessions = tables[0]
            policy.on_session = rig.links[0].session_routed
            ep = rig.tables[0].endpoints["backend-1#0"]
            info = policy_request(policy, b"conv-1")
            policy.routed(ep, info)
            assert tables[0].last(b"conv-1") == "backend-1#0"
            await until(lambda: tables[1].last(b"conv-1") == "backend-1#0")
            # the name as the body's user (str) is the same session as the header's bytes
            policy.routed(rig.tables[0].endpoints["backend-0#0"], policy_request(policy, "conv-1"))
            await until(lambda: tables[1].last(b"conv-1") == "backend-0#0")
            assert rig.links[0].hints_dropped == 0
        finally:
            await rig.close()
    asyncio.run(main())


def policy_request(policy, session):
    from motor.coordinator.policy import RequestInfo
    info = RequestInfo("m", 1, 8)
    info.session = session
    return info
