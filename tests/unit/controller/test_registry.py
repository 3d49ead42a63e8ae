"""Registry state machine, versions, timeouts (fake clock) and the long-poll wait."""
from __future__ import annotations

import asyncio

import pytest

from motor.controller.registry import Registry, RegistryConflict
from motor.protocol.instances import (Endpoint, Heartbeat, InstanceSpec, InstanceState as S,
                                      NodeRegistration)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def spec(iid: str, healthy: bool = False, port: int = 18100) -> InstanceSpec:
    return InstanceSpec(id=iid, model="m", role="union", engine="sim",
                        endpoints=[Endpoint(host="127.0.0.1", port=port)], healthy=healthy)


def reg(node: str, *specs: InstanceSpec) -> NodeRegistration:
    return NodeRegistration(node=node, host="127.0.0.1", instances=list(specs))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def r(clock: FakeClock) -> Registry:
    return Registry(heartbeat_timeout_s=5, remove_after_s=60, clock=clock)


def test_register_starting_and_ready(r: Registry) -> None:
    v0 = r.version
    v = r.register(reg("n", spec("n/a/0"), spec("n/a/1", healthy=True)))
    assert v > v0
    assert r.state("n/a/0") is S.STARTING
    assert r.state("n/a/1") is S.READY
    t = r.table()
    assert t.version == v
    assert [i.id for i in t.instances] == ["n/a/0", "n/a/1"]
    assert all(i.node == "n" for i in t.instances)


def test_register_replaces_node_instances(r: Registry) -> None:
    r.register(reg("n", spec("n/a/0"), spec("n/a/1")))
    r.register(reg("n", spec("n/a/1", healthy=True), spec("n/a/2")))
    assert r.state("n/a/0") is S.REMOVED
    assert r.state("n/a/1") is S.READY
    assert r.state("n/a/2") is S.STARTING
    assert [i.id for i in r.table().instances] == ["n/a/1", "n/a/2"]


def test_register_conflict_with_other_node(r: Registry) -> None:
    r.register(reg("n1", spec("x")))
    v = r.version
    with pytest.raises(RegistryConflict):
        r.register(reg("n2", spec("x")))
    with pytest.raises(RegistryConflict):
        r.register(reg("n2", spec("y"), spec("y")))
    assert r.version == v
    assert r.instance("x").node == "n1"  # type: ignore[union-attr]


def test_heartbeat_transitions(r: Registry) -> None:
    r.register(reg("n", spec("a"), spec("b")))
    known, v1 = r.heartbeat(Heartbeat(node="n", health={"a": False, "b": False}))
    assert known
    assert r.state("a") is S.STARTING  # still booting: stays starting
    known, v2 = r.heartbeat(Heartbeat(node="n", health={"a": True, "b": False}))
    assert v2 > v1
    assert r.state("a") is S.READY and r.state("b") is S.STARTING
    _, v3 = r.heartbeat(Heartbeat(node="n", health={"a": False}))
    assert r.state("a") is S.UNHEALTHY and v3 > v2
    _, v4 = r.heartbeat(Heartbeat(node="n", health={"a": True}))
    assert r.state("a") is S.READY and v4 > v3
    # nothing changes: same version
    _, v5 = r.heartbeat(Heartbeat(node="n", health={"a": True}))
    assert v5 == v4
    # gave up while starting -> unhealthy, with the reason
    _, v6 = r.heartbeat(Heartbeat(node="n", health={"b": False}, failed=["b"],
                                  reasons={"b": "gave up after 3 restarts"}))
    assert r.state("b") is S.UNHEALTHY and v6 > v5
    assert "gave up after 3 restarts" in (r.instance("b").reason or "")  # type: ignore[union-attr]


def test_heartbeat_unknown_node(r: Registry) -> None:
    known, v = r.heartbeat(Heartbeat(node="ghost", health={"x": True}))
    assert not known and v == r.version
    r.register(reg("n", spec("a")))
    # an id of another node is ignored
    r.register(reg("m", spec("b")))
    r.heartbeat(Heartbeat(node="n", health={"b": True}))
    assert r.state("b") is S.STARTING


def test_heartbeat_timeout_then_removal(r: Registry, clock: FakeClock) -> None:
    r.register(reg("n", spec("a", healthy=True), spec("b")))
    r.register(reg("m", spec("c", healthy=True)))
    clock.t += 4
    r.heartbeat(Heartbeat(node="m", health={"c": True}))
    v = r.check()
    assert r.state("a") is S.READY  # 4 s < 5 s
    clock.t += 1.5
    v2 = r.check()
    assert v2 > v
    assert r.state("a") is S.UNHEALTHY and r.state("b") is S.UNHEALTHY
    assert r.state("c") is S.READY  # m heartbeated 1.5 s ago
    assert "no heartbeat" in (r.instance("a").reason or "")  # type: ignore[union-attr]
    assert r.check() == v2  # no change, no bump
    clock.t += 59
    r.check()
    assert r.state("a") is S.UNHEALTHY
    clock.t += 1.1
    v3 = r.check()
    assert v3 > v2
    assert r.state("a") is S.REMOVED and r.state("b") is S.REMOVED
    assert [i.id for i in r.table().instances] == ["c"]
    # the node is forgotten: its next heartbeat asks it to register again
    assert r.heartbeat(Heartbeat(node="n", health={"a": True}))[0] is False


def test_heartbeat_resumes_before_removal(r: Registry, clock: FakeClock) -> None:
    r.register(reg("n", spec("a", healthy=True)))
    clock.t += 10
    r.check()
    assert r.state("a") is S.UNHEALTHY
    r.heartbeat(Heartbeat(node="n", health={"a": True}))
    assert r.state("a") is S.READY
    clock.t += 3
    r.check()
    assert r.state("a") is S.READY


def test_unhealthy_by_heartbeat_is_not_removed_while_node_alive(r: Registry, clock: FakeClock) -> None:
    r.register(reg("n", spec("a", healthy=True)))
    r.heartbeat(Heartbeat(node="n", health={"a": False}))
    for _ in range(100):
        clock.t += 1
        r.heartbeat(Heartbeat(node="n", health={"a": False}))
        r.check()
    assert r.state("a") is S.UNHEALTHY


def test_deregister(r: Registry) -> None:
    r.register(reg("n", spec("a"), spec("b")))
    r.register(reg("m", spec("c")))
    known, v = r.deregister("n")
    assert known
    assert [i.id for i in r.table().instances] == ["c"]
    assert r.deregister("n") == (False, v)
    assert not r.knows("n")


def test_version_strictly_increases_and_listeners(r: Registry, clock: FakeClock) -> None:
    seen: list[tuple[str, str]] = []
    r.listeners.append(lambda ch: seen.extend((t.instance, t.new.value) for t in ch))
    versions = [r.version]
    ops = [
        lambda: r.register(reg("n", spec("a"))),
        lambda: r.heartbeat(Heartbeat(node="n", health={"a": True}))[1],
        lambda: r.heartbeat(Heartbeat(node="n", health={"a": False}))[1],
        lambda: r.register(reg("n", spec("a"), spec("b"))),
        lambda: r.deregister("n")[1],
        lambda: r.register(reg("n", spec("a"))),
    ]
    for op in ops:
        versions.append(op())
    assert versions == sorted(set(versions))
    assert ("a", "ready") in seen and ("a", "unhealthy") in seen and ("b", "removed") in seen


def test_counts_and_nodes(r: Registry) -> None:
    r.register(reg("n", spec("a"), spec("b", healthy=True)))
    c = r.counts()
    assert c[S.STARTING] == 1 and c[S.READY] == 1 and c[S.UNHEALTHY] == 0
    assert r.nodes()[0]["instances"] == ["a", "b"]


def test_long_poll_immediate_change_and_timeout(r: Registry) -> None:
    async def go() -> None:
        r.register(reg("n", spec("a")))
        v = r.version
        # older version: answers at once
        t = await asyncio.wait_for(r.wait(v - 1, 30), 5)
        assert t.version == v
        # no "after": at once
        assert (await asyncio.wait_for(r.wait(None, 30), 5)).version == v
        # a version from another incarnation (higher), after the warm-up: at once
        r.clock.t += r.warmup_s  # type: ignore[attr-defined]
        assert (await asyncio.wait_for(r.wait(v + 100, 30), 5)).version == v
        # waits, then wakes on a change
        waiter = asyncio.create_task(r.wait(v, 30))
        await asyncio.sleep(0)
        assert not waiter.done()
        r.heartbeat(Heartbeat(node="n", health={"a": True}))
        t = await asyncio.wait_for(waiter, 5)
        assert t.version > v
        assert t.instances[0].state is S.READY
        # times out with the same version
        t2 = await asyncio.wait_for(r.wait(t.version, 0.05), 5)
        assert t2.version == t.version
    asyncio.run(go())


def test_long_poll_wakes_many_watchers(r: Registry) -> None:
    async def go() -> None:
        r.register(reg("n", spec("a")))
        v = r.version
        waiters = [asyncio.create_task(r.wait(v, 30)) for _ in range(5)]
        await asyncio.sleep(0)
        r.deregister("n")
        tables = await asyncio.wait_for(asyncio.gather(*waiters), 5)
        assert all(t.version > v and t.instances == [] for t in tables)
    asyncio.run(go())


def test_restarted_registry_holds_followers_of_another_incarnation(clock) -> None:
    """A new controller does not answer a follower of the old one with a table that lacks the
    nodes it has not heard from yet: the poll is held for the warm-up."""
    async def go() -> None:
        r = Registry(heartbeat_timeout_s=5, clock=clock, initial_version=1000, warmup_s=5)
        old = 900   # the last version the previous controller published
        waiter = asyncio.create_task(r.wait(old, 30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        waiter.cancel()
        # a follower that never had a table, or one of this incarnation: at once
        assert (await asyncio.wait_for(r.wait(None, 30), 5)).version == 1000
        assert (await asyncio.wait_for(r.wait(0, 30), 5)).version == 1000
        r.register(reg("n", spec("a", healthy=True)))
        assert (await asyncio.wait_for(r.wait(1000, 30), 5)).version == 1001
        # the warm-up is over: at once, with what the nodes registered meanwhile
        clock.t += 5
        t = await asyncio.wait_for(r.wait(old, 30), 5)
        assert t.version == 1001 and [i.id for i in t.instances] == ["a"]
        # held at most the poll's own timeout
        r2 = Registry(clock=clock, initial_version=5000, warmup_s=100)
        assert (await asyncio.wait_for(r2.wait(900, 0.05), 5)).version == 5000
    asyncio.run(go())
