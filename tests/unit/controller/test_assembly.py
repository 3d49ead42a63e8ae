"""Assembly of instances spanning nodes (motor.controller.assembly through the Registry):
in the table only once every part registered, ready only when every part is healthy, a failed
part restarts the whole instance (every part stopped, then a new epoch after the backoff),
a restarted controller adopts the parts' epoch."""
from __future__ import annotations

import pytest

from motor.controller.registry import Registry, RegistryConflict
from motor.protocol.instances import (Endpoint, Heartbeat, InstancePart, InstanceSpec,
                                      InstanceState, NodeRegistration, PartOrder, PartReport)

IID = "n1/ds/0"
NODES = ["n1", "n2"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def part(node: str, epoch: int = 0, **kw: object) -> InstancePart:
    rank = NODES.index(node)
    spec = InstanceSpec(id=IID, model="ds", role="union", engine="vllm", dp_size=4,
                        endpoints=[Endpoint(host="10.0.0.1", port=8000)]) if rank == 0 else None
    return InstancePart(instance=IID, nodes=NODES, node_rank=rank, dp_start_rank=2 * rank,
                        dp_size_local=2, spec=spec,
                        master_host="10.0.0.1" if rank == 0 else None,
                        master_port=13345 if rank == 0 else None, epoch=epoch,
                        restart_backoff_initial_s=0.5, restart_backoff_max_s=4.0, **kw)


def register(reg: Registry, node: str, epoch: int = 0, **kw: object) -> None:
    reg.register(NodeRegistration(node=node, host=node, parts=[part(node, epoch, **kw)]))


def beat(reg: Registry, node: str, epoch: int, healthy: bool = True, failed: bool = False,
         reason: str | None = None) -> None:
    known, _ = reg.heartbeat(Heartbeat(node=node, parts={IID: PartReport(
        epoch=epoch, healthy=healthy, failed=failed, reason=reason)}))
    assert known


def order(reg: Registry, node: str) -> PartOrder:
    (o,) = reg.orders(node)
    return o


@pytest.fixture()
def reg() -> Registry:
    return Registry(heartbeat_timeout_s=2.0, remove_after_s=10.0, clock=Clock())


def running(reg: Registry) -> int:
    """Both parts registered, started at the ordered epoch and healthy; returns the epoch."""
    register(reg, "n1")
    register(reg, "n2")
    e = order(reg, "n1").epoch
    beat(reg, "n1", e)
    beat(reg, "n2", e)
    assert reg.state(IID) is InstanceState.READY
    return e


def test_the_instance_enters_the_table_only_when_every_part_registered(reg: Registry) -> None:
    register(reg, "n2")
    assert reg.table().instances == []
    assert order(reg, "n2") == PartOrder(instance=IID, epoch=0, run=False)
    register(reg, "n1")
    (inst,) = reg.table().instances
    assert inst.id == IID and inst.node == "n1" and inst.state is InstanceState.STARTING
    assert [e.port for e in inst.endpoints] == [8000] and inst.dp_size == 4
    for node in NODES:   # both told to run, with the master's address
        assert order(reg, node) == PartOrder(instance=IID, epoch=1, run=True,
                                             master_host="10.0.0.1", master_port=13345)


def test_ready_only_when_every_part_is_healthy(reg: Registry) -> None:
    register(reg, "n1")
    register(reg, "n2")
    beat(reg, "n1", 1)
    assert reg.state(IID) is InstanceState.STARTING   # n2 has not started its ranks
    beat(reg, "n2", 1, healthy=False, reason="engine starting")
    assert reg.state(IID) is InstanceState.STARTING
    beat(reg, "n2", 1)
    assert reg.state(IID) is InstanceState.READY
    beat(reg, "n1", 1, healthy=False, reason="health probe failing")
    inst = reg.instance(IID)
    assert inst is not None and inst.state is InstanceState.UNHEALTHY
    assert inst.reason == "node n1: health probe failing"


def test_a_failed_part_restarts_the_whole_instance_with_backoff(reg: Registry) -> None:
    clock = reg.clock
    assert isinstance(clock, Clock)
    e = running(reg)
    beat(reg, "n2", e, healthy=False, failed=True, reason="exited with signal 9")
    inst = reg.instance(IID)
    assert inst is not None and inst.state is InstanceState.UNHEALTHY
    assert inst.reason == ("node n2: exited with signal 9; restarting the whole instance "
                           f"(epoch {e + 1}) in 0.50 s")
    # every part stops at once (the master too), nothing runs during the backoff
    assert [order(reg, n).run for n in NODES] == [False, False]
    beat(reg, "n1", 0, healthy=False)
    beat(reg, "n2", 0, healthy=False)
    clock.t += 0.4
    reg.check()
    assert order(reg, "n1").run is False
    clock.t += 0.2
    reg.check()
    assert [order(reg, n) for n in NODES] == [PartOrder(
        instance=IID, epoch=e + 1, run=True, master_host="10.0.0.1", master_port=13345)] * 2
    assert reg.state(IID) is InstanceState.STARTING
    beat(reg, "n1", e + 1)
    beat(reg, "n2", e + 1)
    assert reg.state(IID) is InstanceState.READY
    # a second failure in a row waits longer only if the instance was not ready between
    beat(reg, "n1", e + 1, healthy=False, failed=True)
    assert reg.instance(IID).reason.endswith("in 0.50 s")  # type: ignore[union-attr]


def test_restarts_in_a_row_double_the_backoff(reg: Registry) -> None:
    clock = reg.clock
    assert isinstance(clock, Clock)
    e = running(reg)
    for delay in ("0.50", "1.00", "2.00", "4.00", "4.00"):
        beat(reg, "n2", e, healthy=False, failed=True)
        assert reg.instance(IID).reason.endswith(f"in {delay} s")  # type: ignore[union-attr]
        clock.t += 5
        reg.check()
        e = order(reg, "n1").epoch
        beat(reg, "n1", e, healthy=False)
        beat(reg, "n2", e, healthy=False)


def test_a_part_whose_node_manager_restarted_restarts_the_instance(reg: Registry) -> None:
    e = running(reg)
    register(reg, "n2", epoch=0)    # came back without its ranks
    inst = reg.instance(IID)
    assert inst is not None and inst.state is InstanceState.UNHEALTHY
    assert "node n2 registered again without its part running" in (inst.reason or "")
    assert order(reg, "n1").run is False and order(reg, "n1").epoch == e


def test_a_silent_node_makes_the_instance_unhealthy(reg: Registry) -> None:
    clock = reg.clock
    assert isinstance(clock, Clock)
    e = running(reg)
    clock.t += 3
    beat(reg, "n1", e)
    reg.check()
    inst = reg.instance(IID)
    assert inst is not None and inst.state is InstanceState.UNHEALTHY
    assert (inst.reason or "").startswith("no heartbeat from node n2")
    beat(reg, "n2", e)
    assert reg.state(IID) is InstanceState.READY   # no restart: its ranks ran all along


def test_a_deregistered_part_takes_the_instance_out_of_the_table(reg: Registry) -> None:
    running(reg)
    reg.deregister("n2")
    assert reg.table().instances == []
    assert order(reg, "n1").run is False
    register(reg, "n2")
    assert order(reg, "n1").run is True and order(reg, "n1").epoch == 2


def test_a_new_controller_adopts_the_epoch_the_parts_run_at() -> None:
    reg = Registry(clock=Clock())
    register(reg, "n1", epoch=7)
    register(reg, "n2", epoch=7)
    assert order(reg, "n2") == PartOrder(instance=IID, epoch=7, run=True,
                                         master_host="10.0.0.1", master_port=13345)
    beat(reg, "n1", 7)
    beat(reg, "n2", 7)
    assert reg.state(IID) is InstanceState.READY


def test_restart_policy_never_leaves_it_stopped(reg: Registry) -> None:
    register(reg, "n1", restart_policy="never")
    register(reg, "n2")
    beat(reg, "n1", 1)
    beat(reg, "n2", 1, failed=True, healthy=False, reason="exited with status 1")
    inst = reg.instance(IID)
    assert inst is not None and inst.state is InstanceState.UNHEALTHY
    assert inst.reason == "node n2: exited with status 1; not restarted (restart policy never)"
    assert order(reg, "n1").run is False


def test_parts_that_do_not_fit_are_refused(reg: Registry) -> None:
    register(reg, "n1")
    other = part("n2").model_copy(update={"nodes": ["n1", "n2", "n3"]})
    with pytest.raises(RegistryConflict, match="nodes of node 'n2'"):
        reg.register(NodeRegistration(node="n2", parts=[other]))
    spec = InstanceSpec(id=IID, model="m", role="union", engine="sim",
                        endpoints=[Endpoint(host="h", port=1)])
    with pytest.raises(RegistryConflict, match="spans nodes"):
        reg.register(NodeRegistration(node="n3", instances=[spec]))


def test_node_records_carry_the_parts_and_restore_them() -> None:
    reg = Registry(clock=Clock())
    e = running(reg)
    records = [r for n in NODES if (r := reg.node_record(n)) is not None]
    assert records[0]["parts"][0]["epoch"] == e  # type: ignore[index]
    new = Registry(clock=Clock())
    new.restore(records, reg.version)
    assert new.state(IID) is InstanceState.STARTING
    assert order(new, "n2").epoch == e and order(new, "n2").run   # no restart
    beat(new, "n1", e)
    beat(new, "n2", e)
    assert new.state(IID) is InstanceState.READY


def test_operator_actions_order_every_part(reg: Registry) -> None:
    """drain holds ``draining`` whatever the heartbeats say; stop orders every part to stop
    (``stopped``, no restart on failures); start orders a new epoch (``starting``, then
    ``ready`` once every part runs it); an unknown or unassembled instance is refused."""
    e = running(reg)
    assert reg.spanning(IID)
    reg.act(IID, "drain")
    assert reg.state(IID) is InstanceState.DRAINING
    beat(reg, "n1", e)
    beat(reg, "n2", e)
    assert reg.state(IID) is InstanceState.DRAINING and order(reg, "n1").run
    reg.act(IID, "stop")
    assert reg.state(IID) is InstanceState.STOPPED
    assert not order(reg, "n1").run and not order(reg, "n2").run
    beat(reg, "n2", e, healthy=False, failed=True)     # its processes ended: no restart
    reg.check()
    assert reg.state(IID) is InstanceState.STOPPED and not order(reg, "n2").run
    reg.act(IID, "start")
    assert reg.state(IID) is InstanceState.STARTING
    assert order(reg, "n1") == order(reg, "n1").model_copy(update={"epoch": e + 1, "run": True})
    beat(reg, "n1", e + 1)
    beat(reg, "n2", e + 1)
    assert reg.state(IID) is InstanceState.READY
    reg.act(IID, "restart")
    assert order(reg, "n2").epoch == e + 2 and reg.state(IID) is InstanceState.STARTING


def test_operator_action_on_an_unassembled_instance_is_refused(reg: Registry) -> None:
    from motor.controller.registry import UnknownInstance
    register(reg, "n1")
    with pytest.raises(UnknownInstance):
        reg.act(IID, "stop")
