"""Operator actions in the registry (drain / stop / start / restart, acknowledged by
heartbeats) and the node records the etcd backend persists and restores."""
from __future__ import annotations

import pytest

from motor.controller.registry import Registry, UnknownInstance
from motor.protocol.instances import (Endpoint, Heartbeat, InstanceSpec, InstanceState as S,
                                      NodeRegistration)


def _reg(r: Registry, *ids: str) -> None:
    r.register(NodeRegistration(node="n1", host="10.0.0.1", mgmt_port=9100, instances=[
        InstanceSpec(id=i, model="m", role="union", engine="sim", healthy=True,
                     endpoints=[Endpoint(host="127.0.0.1", port=18100 + k)])
        for k, i in enumerate(ids)]))


def hb(health: dict[str, bool], draining: list[str] = (), stopped: list[str] = ()) -> Heartbeat:
    return Heartbeat(node="n1", health=health, draining=list(draining), stopped=list(stopped))


@pytest.fixture
def r() -> Registry:
    reg = Registry(heartbeat_timeout_s=5, remove_after_s=60, clock=lambda: 100.0)
    _reg(reg, "a", "b")
    return reg


def test_drain_holds_until_acknowledged_then_stopped(r: Registry) -> None:
    v = r.version
    assert r.act("a", "drain") == v + 1
    assert r.state("a") is S.DRAINING
    r.heartbeat(hb({"a": True, "b": True}))             # sent before the node manager knew
    assert r.state("a") is S.DRAINING                    # the operator's state holds
    r.heartbeat(hb({"a": True, "b": True}, draining=["a"]))
    assert r.state("a") is S.DRAINING
    r.heartbeat(hb({"a": False, "b": True}, stopped=["a"]))
    assert r.state("a") is S.STOPPED and r.state("b") is S.READY
    r.heartbeat(hb({"a": False, "b": True}, stopped=["a"]))
    assert r.state("a") is S.STOPPED                     # not unhealthy: stopped on purpose


def test_start_from_stopped_goes_starting_then_ready(r: Registry) -> None:
    r.heartbeat(hb({"a": False, "b": True}, stopped=["a"]))
    assert r.state("a") is S.STOPPED
    r.act("a", "start")
    assert r.state("a") is S.STARTING
    r.heartbeat(hb({"a": False, "b": True}, stopped=["a"]))   # stale: still says stopped
    assert r.state("a") is S.STARTING
    r.heartbeat(hb({"a": False, "b": True}))
    assert r.state("a") is S.STARTING                    # acknowledged; not healthy = starting
    r.heartbeat(hb({"a": True, "b": True}))
    assert r.state("a") is S.READY
    r.heartbeat(hb({"a": False, "b": True}))
    assert r.state("a") is S.UNHEALTHY                   # the action is over: usual mapping


def test_restart_without_drain_is_stopped_then_starting_then_ready(r: Registry) -> None:
    r.act("a", "restart", drain=False)
    assert r.state("a") is S.STOPPED
    r.heartbeat(hb({"a": True, "b": True}))              # stale
    assert r.state("a") is S.STOPPED
    r.heartbeat(hb({"a": False, "b": True}))             # the engine is coming back up
    assert r.state("a") is S.STARTING
    r.heartbeat(hb({"a": True, "b": True}))
    assert r.state("a") is S.READY


def test_restart_with_drain_passes_every_state(r: Registry) -> None:
    seen = []
    r.listeners.append(lambda ch: seen.extend((t.instance, t.new) for t in ch))
    r.act("a", "restart")
    for beat in (hb({"a": True}, draining=["a"]), hb({"a": False}, stopped=["a"]),
                 hb({"a": False}), hb({"a": True})):
        r.heartbeat(beat)
    assert [s for i, s in seen if i == "a"] == [S.DRAINING, S.STOPPED, S.STARTING, S.READY]


def test_act_errors(r: Registry) -> None:
    with pytest.raises(UnknownInstance):
        r.act("zzz", "drain")
    with pytest.raises(ValueError, match="action: expected one of drain, stop, start, restart"):
        r.act("a", "pause")
    assert r.node_of("a") == ("n1", "10.0.0.1", 9100)
    with pytest.raises(UnknownInstance):
        r.node_of("zzz")


def test_node_records_round_trip_with_pending_actions(r: Registry) -> None:
    r.act("a", "drain")
    assert r.take_dirty() == {"n1"}
    assert r.take_dirty() == set()
    rec = r.node_record("n1")
    assert rec is not None and rec["mgmt_port"] == 9100
    r2 = Registry(heartbeat_timeout_s=5, remove_after_s=60, clock=lambda: 500.0,
                  initial_version=1, warmup_s=0)
    r2.restore([rec], r.version)
    assert r2.version == r.version + 1                   # continues above the stored version
    r3 = Registry(initial_version=10**12)
    r3.restore([rec], r.version)
    assert r3.version == 10**12                          # or from its own (clock) start
    assert r2.table().instances == r.table().instances
    assert r2.state("a") is S.DRAINING
    r2.heartbeat(hb({"a": True, "b": True}))              # the pending drain survived
    assert r2.state("a") is S.DRAINING
    assert r2.nodes()[0]["last_heartbeat_age_s"] == 0     # just heard from
    r2.deregister("n1")
    assert r2.take_dirty() == {"n1"} and r2.node_record("n1") is None


def test_restore_refuses_a_bad_record() -> None:
    r = Registry()
    with pytest.raises(ValueError, match="node record 'n9' in etcd does not validate"):
        r.restore([{"node": "n9", "host": "h", "instances": [{"instance": {"id": ""}}]}], 3)


def test_heartbeats_that_change_nothing_dirty_nothing(r: Registry) -> None:
    r.take_dirty()
    r.heartbeat(hb({"a": True, "b": True}))
    assert r.take_dirty() == set()
    r.heartbeat(hb({"a": False, "b": True}))
    assert r.take_dirty() == {"n1"}
    r.check(now=100.0 + 1)
    assert r.take_dirty() == set()
