"""The pieces the coordinator's processes share: ring record codec, readiness and
liveness answers, the controller long poll, the KV router's routed hook, /metrics text."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from motor.config.schema import KvRoutingConfig
from motor.control_link import ControllerLink
from motor.coordinator import controller_poll, probes
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.metrics import render_metrics
from motor.coordinator.rings import (OP_CLEAR, OP_STORE, decode_hint, decode_nonce,
                                     decode_ops, encode_hint, encode_nonce, encode_op)
from motor.protocol.instances import InstanceTable


class FakeResponse:
    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []

    def send(self, status: int, body: bytes = b"", **kw: object) -> None:
        self.sent.append((status, body))


def test_ring_codec_round_trips():
    h = np.array([1, 2, 2**64 - 1], np.uint64)
    p = encode_op(OP_STORE, 7, 1, 42, h) + encode_op(OP_CLEAR, 3)
    (op1, s1, t1, par1, h1), (op2, s2, t2, par2, h2) = decode_ops(p)
    assert (op1, s1, t1, par1, h1.tolist()) == (OP_STORE, 7, 1, 42, h.tolist())
    assert (op2, s2, t2, par2, len(h2)) == (OP_CLEAR, 3, 0, 0, 0)
    slot, group, hh = decode_hint(encode_hint(5, "m", h))
    assert (slot, group, hh.tolist()) == (5, "m", h.tolist())
    assert decode_hint(encode_hint(5, None, h))[1] is None
    assert decode_nonce(encode_nonce(2**63 + 1)) == 2**63 + 1


def test_readiness_and_health_bodies():
    r = FakeResponse()
    probes.readiness(r, 2, True)
    assert r.sent[-1] == (200, b'{"status":"ready","routable_endpoints":2}')
    probes.readiness(r, 2, False)
    assert r.sent[-1] == (503, b'{"status":"not ready","routable_endpoints":2,'
                               b'"instance_table_synced":false}')
    probes.readiness(r, 0, True, workers_synced=[True, True])
    assert r.sent[-1][0] == 503
    assert orjson.loads(r.sent[-1][1]) == {"status": "not ready", "routable_endpoints": 0,
                                          "instance_table_synced": True,
                                          "workers_synced": [True, True]}
    asyncio.run(probes.health(None, r))  # type: ignore[arg-type]
    assert r.sent[-1] == (200, b'{"status":"ok"}')


class ScriptedClient:
    """Answers the long poll from a script; then holds like a controller with no news."""

    def __init__(self, script: list[object]) -> None:
        self.script = script
        self.paths: list[str] = []

    async def get_json_bytes(self, host: str, port: int, path: str, timeout: float):
        self.paths.append(path)
        if not self.script:
            await asyncio.Event().wait()
        a = self.script.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


def _table(v: int) -> tuple[int, bytes]:
    return 200, InstanceTable(version=v).model_dump_json().encode()


def test_follow_controller_applies_new_versions_and_sets_synced(monkeypatch):
    monkeypatch.setattr(controller_poll, "RETRY_S", 0.0)

    async def main() -> None:
        client = ScriptedClient([ConnectionRefusedError("down"), (503, b""), (200, b"junk"),
                                 _table(1), _table(1), _table(3), _table(2)])
        seen: list[int] = []
        synced = asyncio.Event()
        link = ControllerLink("http://h:1", client)  # type: ignore[arg-type]
        task = asyncio.ensure_future(controller_poll.follow_controller(
            link, lambda t: seen.append(t.version), synced, 10.0))
        await asyncio.wait_for(synced.wait(), 2)
        while client.script:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert seen == [1, 3, 2]   # a lower version (controller restarted) is taken as is
        assert client.paths[:4] == ["/v1/instances?after=0&timeout=10"] * 4
        assert client.paths[4:] == ["/v1/instances?after=1&timeout=10"] * 2 + [
            "/v1/instances?after=3&timeout=10", "/v1/instances?after=2&timeout=10"]
    asyncio.run(main())


def test_controller_address():
    assert controller_poll.controller_address("http://c:18500") == ("c", 18500)
    assert controller_poll.controller_address("http://c") == ("c", 80)
    with pytest.raises(ValueError):
        controller_poll.controller_address("c:18500")


def test_kv_router_calls_on_routed_after_an_approximate_insertion():
    calls: list[tuple[str, object, list[int]]] = []
    r = KvRouter(KvRoutingConfig(), on_routed=lambda ep, g, h: calls.append((ep.key, g, h.tolist())))
    ep = SimpleNamespace(key="a#0")
    h = np.array([11, 12], np.uint64)
    r.routed(ep, None, h)  # type: ignore[arg-type]
    assert calls == [("a#0", None, [11, 12])]
    r.routed(ep, None, None)  # type: ignore[arg-type]
    r.routed(ep, None, np.zeros(0, np.uint64))  # type: ignore[arg-type]
    r.event_slots.add(r.slot("a#0"))          # mode auto: an endpoint with events
    r.routed(ep, None, h)  # type: ignore[arg-type]
    assert len(calls) == 1


def test_render_metrics_of_this_process(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert b"motor_coordinator_requests_total" in render_metrics()


def test_controller_watcher_learns_each_endpoints_context_length() -> None:
    """Controller mode: the engine's max_model_len (its /v1/models) is fetched once per
    endpoint, for failover continuations of requests without a length bound."""
    import asyncio

    import orjson as _orjson

    from motor.config.schema import EngineKind, Role
    from motor.coordinator.endpoints import ControllerWatcher, EndpointTable
    from motor.http.client import Client
    from motor.http.server import HttpServer, Request, Response
    from motor.protocol.instances import Endpoint, Instance, InstanceState, InstanceTable

    async def engine(req: Request, resp: Response) -> None:
        resp.send(200, _orjson.dumps({"object": "list", "data": [
            {"id": "m", "object": "model", "max_model_len": 3072}]}))

    async def main() -> None:
        srv = HttpServer(engine)
        port = await srv.listen("127.0.0.1", 0)
        client = Client()
        table = EndpointTable(client)
        w = ControllerWatcher(table, "http://127.0.0.1:9")
        try:
            w._apply(InstanceTable(version=1, instances=[Instance(
                id="i", model="m", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                endpoints=[Endpoint(host="127.0.0.1", port=port)], state=InstanceState.READY)]))
            (ep,) = table.endpoints.values()
            for _ in range(100):
                if ep.max_model_len is not None:
                    break
                await asyncio.sleep(0.02)
            assert ep.max_model_len == 3072
        finally:
            w.close()
            client.close()
            await srv.shutdown(0.5)
    asyncio.run(main())
