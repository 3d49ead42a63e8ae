"""Per-instance caps (``InstanceSpec.max_inflight``, ``admission.max_inflight_per_instance``)
and shedding on the engines' reported queue (``admission.shed_waiting``): the node manager's
limit, :meth:`EndpointTable.with_room`, :class:`SlotQueue`."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from motor.config.schema import EngineConfig, NodeConfig, Role
from motor.coordinator.admission import SlotQueue, Refused
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.loadtable import LoadTable
from motor.http.client import Client
from motor.node_manager.engines import ENGINE_LIMIT_KEYS, plan_node
from motor.protocol.instances import InstanceSpec, InstanceTable
from tests.support.gateway import run_async


def _limit(kind: str, **kw: object) -> int | None:
    (plan,) = plan_node(NodeConfig(name="n", engines=[EngineConfig(
        name="e", kind=kind, model="/m", base_port=9000, **kw)]))
    return plan.spec().max_inflight


def test_the_node_manager_registers_the_engines_own_limit() -> None:
    assert _limit("vllm", engine_config={"max_num_seqs": 8}) == 8
    assert _limit("vllm", engine_config={"--max-num-seqs": "12"}) == 12
    assert _limit("sglang", engine_config={"max-running-requests": 5}) == 5
    assert _limit("sim", engine_config={"max_num_seqs": 3}) == 3
    assert _limit("sim", max_inflight=2, engine_config={"max_num_seqs": 3}) == 2
    assert _limit("vllm") is None                      # the engine's default is not assumed
    assert _limit("sglang", engine_config={"max_num_seqs": 4}) is None   # not SGLang's key


def test_the_limit_keys_are_the_engines_flags() -> None:
    assert ENGINE_LIMIT_KEYS == {"vllm": "max_num_seqs", "sglang": "max_running_requests",
                                 "sim": "max_num_seqs"}


def test_max_inflight_is_validated_and_optional_on_the_wire() -> None:
    with pytest.raises(ValueError, match="max_inflight"):
        EngineConfig(name="e", model="/m", max_inflight=0)
    old = {"id": "n/e/0", "model": "m", "role": "union", "engine": "sim",
           "endpoints": [{"host": "127.0.0.1", "port": 9000}]}
    assert InstanceSpec.model_validate(old).max_inflight is None   # an old node manager
    assert InstanceSpec.model_validate(old | {"max_inflight": 4}).max_inflight == 4
    with pytest.raises(ValueError):
        InstanceSpec.model_validate(old | {"max_inflight": 0})


def _table(*caps: int | None) -> InstanceTable:
    return InstanceTable.model_validate({"version": 1, "instances": [
        {"id": f"n/e/{i}", "node": "n", "model": "m", "role": "union", "engine": "sim",
         "state": "ready", "max_inflight": cap,
         "endpoints": [{"host": "127.0.0.1", "port": 39100 + i}]}
        for i, cap in enumerate(caps)]})


@run_async
async def test_an_endpoint_at_its_cap_is_not_a_candidate() -> None:
    t = EndpointTable(Client())
    t.apply(_table(2, None))
    a, b = t.candidates(Role.UNION, "m")
    assert (a.max_inflight, b.max_inflight) == (2, 0) and t.gated
    assert t.with_room([a, b]) == [a, b]
    la, lb = a.lease(), a.lease()
    assert t.with_room([a, b]) == [b]          # b has no cap
    assert t.with_room([a]) is None
    la.release()
    assert t.with_room([a]) == [a]
    lb.release()


@run_async
async def test_the_coordinator_default_caps_endpoints_without_their_own() -> None:
    t = EndpointTable(Client())
    t.set_static([(Role.UNION, "127.0.0.1", 39200)])
    assert not t.gated                          # no cap, no shedding: the request path skips
    t.configure_caps(3, 0, 1.0)
    (ep,) = t.all(Role.UNION)
    assert ep.max_inflight == 3 and t.gated
    t.apply(_table(1))                          # its own limit wins over the default
    (ep,) = t.all(Role.UNION)
    assert ep.max_inflight == 1
    t.configure_caps(0, 0, 1.0)
    assert ep.max_inflight == 1 and t.gated


@pytest.fixture
def shared():
    lt = LoadTable.create(f"motor-test-caps-{uuid.uuid4().hex[:12]}", n_workers=2, n_slots=4)
    try:
        yield lt
    finally:
        lt.close()
        lt.unlink()


@run_async
async def test_with_several_workers_the_cap_counts_the_whole_coordinator(shared) -> None:
    t = EndpointTable(Client())
    t.apply(_table(2))
    (ep,) = t.all(Role.UNION)
    ep.shared = shared.cell(0, 0, 1)
    shared.cell(1, 0, 1).acquire(0, 0, 0)     # another worker's request
    with ep.lease():
        assert ep.inflight == 1 and ep.inflight_total() == 2
        assert t.with_room([ep]) is None


@run_async
async def test_two_workers_taking_the_last_slot_at_once_see_each_other(shared) -> None:
    # worker 0 and worker 1 both found 1 of 2 slots in use and counted their request; the
    # one that reads the table after that (fence first) sees the cap passed and backs off
    t = EndpointTable(Client())
    t.apply(_table(2))
    (ep,) = t.all(Role.UNION)
    ep.shared = shared.cell(0, 0, 1)
    other = shared.cell(1, 0, 1)
    with ep.lease():
        assert not ep.over_cap()               # 1 of 2: room
        other.acquire(0, 0, 0)                 # worker 1's first request
        with ep.lease() as mine:               # worker 0 takes what it saw as the last slot
            other.acquire(0, 0, 0)             # ... and so does worker 1, at once
            assert ep.inflight_total() == 4 and ep.over_cap()
            mine.release()                     # worker 0 backs off
        other.release(0, 0, 0)
        assert ep.inflight_total() == 2 and not ep.over_cap()
    ep.shared = None
    with ep.lease():                           # one worker: never over by its own count
        assert not ep.over_cap()


@run_async
async def test_an_engine_reporting_a_queue_is_skipped_while_another_has_none(shared) -> None:
    t = EndpointTable(Client())
    t.apply(_table(None, None))
    t.configure_caps(0, 4, 1.0, engine_max_age_s=5.0)
    a, b = t.all(Role.UNION)
    a.shared, b.shared = shared.cell(0, 0, 1), shared.cell(0, 1, 1)
    now = time.time()
    shared.write_engine(0, 4.0, 8.0, 0.5, now)
    shared.write_engine(1, 3.0, 8.0, 0.5, now)
    assert t.with_room([a, b]) == [b]
    shared.write_engine(1, 9.0, 8.0, 0.5, now)
    assert t.with_room([a, b]) == [a, b]       # all queue: none is skipped
    shared.write_engine(0, 9.0, 8.0, 0.5, now - 60)
    assert t.with_room([a, b]) == [a]          # stale figures are not believed
    t.configure_caps(0, 0, 1.0)
    assert not t.gated


@run_async
async def test_waiters_get_slots_in_arrival_order_and_time_out_with_retry_after() -> None:
    q = SlotQueue(timeout_s=5.0)
    free = [0]
    order: list[int] = []

    def room() -> int | None:
        if free[0]:
            free[0] -= 1
            return 1
        return None

    async def one(i: int) -> None:
        await q.wait(room)
        order.append(i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
    await asyncio.sleep(0.01)
    assert q.queued == 4 and not order
    for n in range(4):
        free[0] += 1
        q.pump()
        while len(order) <= n:
            await asyncio.sleep(0)
    assert order == [0, 1, 2, 3] and q.queued == 0
    await asyncio.gather(*tasks)

    q.timeout_s = 0.1
    with pytest.raises(Refused) as e:
        await q.wait(lambda: None)
    assert e.value.reason == "instance cap" and e.value.retry_after_s >= 1
    assert q.queued == 0 and q.refused == 1


@run_async
async def test_a_cancelled_waiter_leaves_and_passes_its_wake_up_on() -> None:
    q = SlotQueue(timeout_s=5.0)
    free = [0]

    def room() -> int | None:
        if free[0]:
            free[0] -= 1
            return 1
        return None

    first = asyncio.ensure_future(q.wait(room))
    second = asyncio.ensure_future(q.wait(room))
    await asyncio.sleep(0.01)
    free[0] = 1
    q.pump()
    first.cancel()
    assert await second == 1
    assert first.cancelled() and q.queued == 0


@run_async
async def test_the_head_of_the_queue_finds_room_without_a_wake_up() -> None:
    """Another worker's request ended (no release in this process): the head polls."""
    q = SlotQueue(timeout_s=5.0)
    free = [0]
    waiter = asyncio.ensure_future(q.wait(lambda: 7 if free[0] else None))
    await asyncio.sleep(0.01)
    free[0] = 1
    assert await asyncio.wait_for(waiter, 1.0) == 7
