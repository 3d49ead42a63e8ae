"""EndpointTable.candidates keeps its lists between candidacy changes, and only those.

A cached list must never route to an endpoint that left (not ready, breaker open, model
unloaded, removed from the table), nor miss one that came back, including a breaker whose
open period ends with no event at all (time alone)."""
from __future__ import annotations

import time

from motor.config.schema import Role
from motor.coordinator import endpoints
from motor.coordinator.endpoints import EndpointTable
from motor.http.client import Client
from motor.protocol.instances import InstanceTable
from tests.support.gateway import run_async


def table(version: int, *ports: int, model: str = "m") -> InstanceTable:
    return InstanceTable.model_validate({"version": version, "instances": [
        {"id": f"n0/sim/{p}", "node": "n0", "model": model, "role": "union", "engine": "sim",
         "state": "ready", "endpoints": [{"host": "127.0.0.1", "port": p}]} for p in ports]})


def ports(t: EndpointTable, model: str | None = "m") -> list[int]:
    return sorted(e.port for e in t.candidates(Role.UNION, model))


@run_async
async def test_a_kept_list_follows_every_candidacy_change():
    client = Client()
    t = EndpointTable(client)
    t.apply(table(1, 39101, 39102))
    a, b = sorted(t.endpoints.values(), key=lambda e: e.port)
    assert ports(t) == [39101, 39102]
    first = t.candidates(Role.UNION, "m")
    first.clear()                            # the caller's copy: the kept list stays whole
    assert ports(t) == [39101, 39102]
    assert ports(t, "other") == []           # a model nobody serves
    # ready
    t.set_ready(a, False, "test")
    assert ports(t) == [39102]
    t.set_ready(a, True, "test")
    assert ports(t) == [39101, 39102]
    a.ready = False                          # set directly, without the table's rebuild
    assert ports(t) == [39102]
    a.ready = True
    assert ports(t) == [39101, 39102]
    # the breaker: opened by failures, closed by a success
    for _ in range(a.breaker.threshold):
        a.failed()
    assert ports(t) == [39102]
    a.succeeded()
    assert ports(t) == [39101, 39102]
    # models: an adapter loaded on one engine only
    b.set_learned({"m", "lora-x"})
    assert ports(t, "lora-x") == [39102]
    b.set_learned({"m"})
    assert ports(t, "lora-x") == []
    # the table: an endpoint added, one removed
    t.apply(table(2, 39101, 39102, 39103))
    assert ports(t) == [39101, 39102, 39103]
    t.apply(table(3, 39103))
    assert ports(t) == [39103]
    client.close()


@run_async
async def test_a_list_that_depends_on_the_time_is_not_kept():
    """An open breaker lets a probe through once its period is over, with no event: the
    lists of its role are worked out again at each call while it is not closed."""
    client = Client()
    t = EndpointTable(client)
    t.apply(table(1, 39111, 39112))
    a, _ = sorted(t.endpoints.values(), key=lambda e: e.port)
    a.breaker.configure(1, 0.05, 0.05)
    a.failed()
    assert ports(t) == [39112]
    time.sleep(0.06)
    assert ports(t) == [39111, 39112]        # half-open probe allowed, nothing else changed
    client.close()


@run_async
async def test_every_breaker_open_gives_every_ready_endpoint_and_is_not_kept():
    client = Client()
    t = EndpointTable(client)
    t.apply(table(1, 39121, 39122))
    for e in t.endpoints.values():
        e.breaker.configure(1, 30, 30)
        e.failed()
    assert ports(t) == [39121, 39122]        # better a retry than a 503
    assert t._cands == {}
    client.close()


@run_async
async def test_the_kept_lists_are_bounded():
    """Standalone backends serve any model name a client sends: one list kept per name, up
    to the bound, the rest worked out at each call."""
    client = Client()
    t = EndpointTable(client)
    t.set_static([(Role.UNION, "127.0.0.1", 39131)])
    n = endpoints.CANDIDATES_CACHED + 50
    for i in range(n):
        assert ports(t, f"model-{i}") == [39131]
    assert len(t._cands) == endpoints.CANDIDATES_CACHED
    assert ports(t, f"model-{n - 1}") == [39131]      # past the bound: still answered
    client.close()
