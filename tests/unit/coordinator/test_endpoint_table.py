"""EndpointTable.apply: endpoints follow the controller's table; removed ones leave no trace."""
from __future__ import annotations

from prometheus_client import generate_latest

from motor.coordinator import metrics
from motor.coordinator.endpoints import EndpointTable
from motor.http.client import Client
from motor.protocol.instances import InstanceTable
from tests.support.gateway import run_async


def table(version: int, *ports: int) -> InstanceTable:
    return InstanceTable.model_validate({"version": version, "instances": [
        {"id": f"n0/sim/{p}", "node": "n0", "model": "m", "role": "union", "engine": "sim",
         "state": "ready", "endpoints": [{"host": "127.0.0.1", "port": p}]} for p in ports]})


@run_async
async def test_removed_and_moved_endpoints_drop_pool_and_metric_series():
    client = Client()
    t = EndpointTable(client)
    t.apply(table(1, 39001, 39002))
    assert sorted(e.port for e in t.endpoints.values()) == [39001, 39002]
    client.pool("127.0.0.1", 39001)
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'instance="n0/sim/39002"' in text
    t.apply(table(2, 39001))
    assert [e.port for e in t.endpoints.values()] == [39001]
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'instance="n0/sim/39002"' not in text
    assert ("127.0.0.1", 39002) not in client._pools
    # the same instance id on another port: the old endpoint is retired first
    moved = table(3, 39001)
    moved.instances[0].endpoints[0].port = 39003
    t.apply(moved)
    assert [e.port for e in t.endpoints.values()] == [39003]
    assert ("127.0.0.1", 39001) not in client._pools
    text = generate_latest(metrics.REGISTRY).decode()
    # this instance's series (another test's backend may happen to use port 39001 too)
    assert 'endpoint="http://127.0.0.1:39001",instance="n0/sim/39001"' not in text
    assert 'endpoint="http://127.0.0.1:39003",instance="n0/sim/39001"' in text
    client.close()


@run_async
async def test_registered_model_and_engine_list_combine():
    """Controller mode: an endpoint serves its instance's registered model and what its
    engine lists (LoRA adapters); a re-registration with another model moves it over."""
    client = Client()
    t = EndpointTable(client)
    t.apply(table(1, 39011))
    (ep,) = t.endpoints.values()
    assert ep.models == {"m"} and ep.learned is None
    ep.set_learned({"m", "sql-lora"})
    assert ep.models == {"m", "sql-lora"} and t.models() == ["m", "sql-lora"]
    ep.set_learned({"sql-lora"})            # a list without the registered name keeps it
    assert ep.models == {"m", "sql-lora"}
    other = table(2, 39011)
    other.instances[0].model = "m2"
    t.apply(other)
    assert t.endpoints[ep.key] is ep and ep.model == "m2"
    assert ep.models == {"m2", "sql-lora"}
    client.close()
