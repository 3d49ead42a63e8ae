"""The controller's HTTP API in-process on 127.0.0.1 (motor.http client)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from motor.config.schema import ControllerConfig
from motor.controller.server import ControllerServer
from motor.http import Client


class FakeClock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def run(fn: Callable[[ControllerServer, Client, FakeClock], Awaitable[None]], **cfg: Any) -> None:
    async def go() -> None:
        clock = FakeClock()
        srv = ControllerServer(ControllerConfig(host="127.0.0.1", port=18500, **cfg), clock=clock)
        await srv.start(port=0)
        client = Client()
        try:
            await fn(srv, client, clock)
        finally:
            client.close()
            await srv.stop()
    asyncio.run(go())


async def post(srv: ControllerServer, c: Client, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    st, b = await c.post_json_bytes("127.0.0.1", srv.port, path, data, 5)  # type: ignore[arg-type]
    return st, orjson.loads(b)


async def get(srv: ControllerServer, c: Client, path: str, timeout: float = 5) -> tuple[int, bytes]:
    return await c.get_json_bytes("127.0.0.1", srv.port, path, timeout)  # type: ignore[arg-type]


INST = {"id": "n/sim/0", "model": "m", "role": "union", "engine": "sim",
        "endpoints": [{"host": "127.0.0.1", "port": 18100}]}


def test_register_heartbeat_watch_deregister() -> None:
    async def body(srv: ControllerServer, c: Client, clock: FakeClock) -> None:
        st, r = await post(srv, c, "/v1/nodes/register",
                           {"node": "n", "host": "127.0.0.1", "instances": [INST]})
        assert st == 200
        v = r["version"]
        st, raw = await get(srv, c, f"/v1/instances?after={v - 1}")
        t = orjson.loads(raw)
        assert t["version"] == v and t["instances"][0]["state"] == "starting"
        assert t["instances"][0]["node"] == "n"
        # long poll woken by a heartbeat
        watch = asyncio.create_task(get(srv, c, f"/v1/instances?after={v}&timeout=20", 25))
        await asyncio.sleep(0.05)
        assert not watch.done()
        st, r = await post(srv, c, "/v1/nodes/heartbeat", {"node": "n", "health": {"n/sim/0": True}})
        assert st == 200 and r["known"] is True and r["version"] > v
        st, raw = await asyncio.wait_for(watch, 10)
        t = orjson.loads(raw)
        assert t["instances"][0]["state"] == "ready" and t["version"] == r["version"]
        # long poll that times out returns the same version
        st, raw = await get(srv, c, f"/v1/instances?after={t['version']}&timeout=0.05")
        assert orjson.loads(raw)["version"] == t["version"]
        st, r = await post(srv, c, "/v1/nodes/heartbeat", {"node": "other", "health": {}})
        assert r["known"] is False
        st, r = await post(srv, c, "/v1/nodes/deregister", {"node": "n"})
        assert st == 200 and r["known"] is True
        st, raw = await get(srv, c, "/v1/instances")
        assert orjson.loads(raw)["instances"] == []
        st, raw = await get(srv, c, "/metrics")
        text = raw.decode()
        assert 'motor_controller_registrations_total 1.0' in text
        assert 'motor_controller_heartbeats_total{known="true"} 1.0' in text
        assert 'motor_controller_instances{state="ready"} 0.0' in text
        for p in ("/health", "/readiness", "/v1/nodes"):
            assert (await get(srv, c, p))[0] == 200
    run(body)


def test_timeouts_drive_states() -> None:
    async def body(srv: ControllerServer, c: Client, clock: FakeClock) -> None:
        await post(srv, c, "/v1/nodes/register",
                   {"node": "n", "instances": [dict(INST, healthy=True)]})
        v = srv.registry.version
        clock.t += 0.5
        st, raw = await get(srv, c, f"/v1/instances?after={v}&timeout=10", 15)
        assert orjson.loads(raw)["instances"][0]["state"] == "unhealthy"
        clock.t += 2
        deadline = asyncio.get_running_loop().time() + 10
        while srv.registry.table().instances and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert srv.registry.table().instances == []
    run(body, heartbeat_timeout_s=0.2, remove_after_s=1.0)


def test_bad_requests() -> None:
    async def body(srv: ControllerServer, c: Client, clock: FakeClock) -> None:
        st, r = await post(srv, c, "/v1/nodes/register", b"{not json")
        assert st == 400 and "error" in r
        st, r = await post(srv, c, "/v1/nodes/register", {"node": "n", "instances": [{"id": "x"}]})
        assert st == 400 and "instances" in r["error"]["message"]
        st, r = await post(srv, c, "/v1/nodes/heartbeat", {"health": {}})
        assert st == 400
        st, r = await post(srv, c, "/v1/nodes/deregister", [1])
        assert st == 400
        await post(srv, c, "/v1/nodes/register", {"node": "a", "instances": [INST]})
        st, r = await post(srv, c, "/v1/nodes/register", {"node": "b", "instances": [INST]})
        assert st == 409
        st, raw = await get(srv, c, "/v1/instances?after=abc")
        assert st == 400
    run(body)


def test_leader_document_names_the_peers_and_any_origin_may_read_it() -> None:
    """``/v1/leader`` lists controller.peers and carries ``access-control-allow-origin: *``
    (the cluster page of a controller that died asks another controller who leads)."""
    peers = ["http://10.0.0.1:18500", "http://10.0.0.2:18500"]

    async def check(srv: ControllerServer, c: Client, clock: FakeClock) -> None:
        assert srv.port is not None
        resp = await c.pool("127.0.0.1", srv.port).request(b"GET", b"/v1/leader")
        async with resp:
            doc = orjson.loads(await resp.read())
            assert resp.header(b"access-control-allow-origin") == b"*"
        assert doc["peers"] == peers and doc["is_leader"] is True and doc["etcd"] is None
        assert doc["leader"] == doc["self"] == srv.url
    run(check, peers=peers)
