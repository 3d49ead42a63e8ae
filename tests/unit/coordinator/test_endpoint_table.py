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
