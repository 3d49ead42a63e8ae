"""The node manager's lifecycle API (drain / stop / start / restart) against real simulated
engines (``motor sim`` processes) and an in-process controller, plus its OpenAPI document."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import orjson

from motor.config.schema import ControllerConfig, NodeConfig
from motor.controller.server import ControllerServer
from motor.http import Client
from motor.node_manager.agent import (INSTANCES_PREFIX, AdminState, EngineInstance, NodeAgent,
                                      openapi_document)
from motor.node_manager.supervisor import ProcState

from .helpers import FAKE_LAUNCHER, await_until, free_ports, pid_alive, run_uvloop

DOC = Path(__file__).resolve().parents[3] / "docs" / "openapi" / "node-manager.json"
REGENERATE = ("python -c 'import json; from motor.node_manager.agent import openapi_document; "
              "print(json.dumps(openapi_document(), indent=2))' > docs/openapi/node-manager.json")


def sim_node(tmp: Path, count: int) -> NodeConfig:
    """``count`` simulated engines; 20 ms per engine step, so a 40-token answer streams for
    about 0.8 s."""
    return NodeConfig(name="n1", log_dir=str(tmp / "logs"), engines=[dict(
        name="sim", kind="sim", model="m", count=count, base_port=free_ports(count),
        health_interval_s=0.05, stop_timeout_s=5, engine_config={"step_fixed_ms": 20},
        restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.2})])


class Cluster:
    """A controller and a node agent on loopback, the agent's management API on any port."""

    def __init__(self, node: NodeConfig) -> None:
        self.srv = ControllerServer(ControllerConfig(port=free_ports(), heartbeat_timeout_s=3,
                                                     remove_after_s=30))
        self.node = node
        self.client = Client()
        self.agent: NodeAgent | None = None

    async def __aenter__(self) -> Cluster:
        await self.srv.start(port=0)
        self.agent = NodeAgent(self.node, self.srv.url, heartbeat_interval_s=0.1, mgmt_port=0)
        await self.agent.start()
        await await_until(lambda: all(i.healthy for i in self.a.instances) and self.a.registered,
                          what="engines healthy and registered")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.client.close()
        if self.agent is not None:
            await self.agent.stop()
        await self.srv.stop()

    @property
    def a(self) -> NodeAgent:
        assert self.agent is not None
        return self.agent

    def inst(self, i: int) -> EngineInstance:
        return self.a.instances[i]

    async def post(self, path: str, body: Any = None, raw: bytes | None = None
                   ) -> tuple[int, dict[str, Any]]:
        data = raw if raw is not None else (b"" if body is None else orjson.dumps(body))
        status, out = await self.client.post_json_bytes("127.0.0.1", self.a.mgmt_port or 0,
                                                        path, data, 20)
        return status, orjson.loads(out)

    async def act(self, instance: str, action: str, body: Any = None
                  ) -> tuple[int, dict[str, Any]]:
        return await self.post(f"{INSTANCES_PREFIX}{instance}/{action}", body)

    async def get(self, path: str) -> Any:
        status, out = await self.client.get_json_bytes("127.0.0.1", self.a.mgmt_port or 0,
                                                       path, 5)
        assert status == 200, out
        return orjson.loads(out)


async def stream_completion(port: int, max_tokens: int, first: asyncio.Event) -> list[bytes]:
    """A streamed completion straight to the engine on ``port``: its SSE chunks, ``first`` set
    once the first one came."""
    c = Client()
    body = orjson.dumps({"model": "m", "prompt": "hello there", "max_tokens": max_tokens,
                         "stream": True, "ignore_eos": True})
    chunks: list[bytes] = []
    try:
        resp = await c.pool("127.0.0.1", port).request(
            b"POST", b"/v1/completions", body, ((b"content-type", b"application/json"),),
            first_byte_timeout_s=10, idle_timeout_s=10)
        async with resp:
            assert resp.status == 200
            async for chunk in resp:
                chunks.append(chunk)
                first.set()
    finally:
        c.close()
    return chunks


def test_drain_lets_the_stream_in_flight_finish_then_stops_the_instance(tmp_path: Path) -> None:
    async def go() -> None:
        async with Cluster(sim_node(tmp_path, 1)) as cl:
            inst = cl.inst(0)
            proc = inst.processes[0]
            pid = proc.pid
            assert pid is not None
            first = asyncio.Event()
            stream = asyncio.create_task(stream_completion(proc.spec.endpoint.port, 40, first))
            await asyncio.wait_for(first.wait(), 10)
            st, out = await cl.act(inst.id, "drain", {"timeout_s": 20, "grace_s": 0.1})
            assert (st, out) == (202, {"instance": inst.id, "action": "drain",
                                       "state": "draining"})
            hb = cl.a.heartbeat()
            assert hb.draining == [inst.id] and hb.stopped == []
            status = await cl.get("/v1/instances")
            assert status["instances"][0]["admin_state"] == "draining"
            assert status["instances"][0]["action"] == "drain"
            # a second drain joins the one under way
            assert (await cl.act(inst.id, "drain"))[0] == 202
            chunks = await asyncio.wait_for(stream, 20)
            ended = time.monotonic()
            # the whole answer came (40 tokens, then [DONE]): the engine ran until the stream
            # was done, and was stopped after it
            events = [e for e in b"".join(chunks).split(b"\n\n") if e.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]"
            tokens = sum(1 for e in events[:-1] if orjson.loads(e[6:])["choices"])
            assert tokens == 40
            await await_until(lambda: inst.admin is AdminState.STOPPED, 20, "drained")
            assert time.monotonic() - ended < 5
            assert not pid_alive(pid) and proc.pid is None
            assert proc.state is ProcState.STOPPED
            hb = cl.a.heartbeat()
            assert hb.stopped == [inst.id] and hb.draining == [] and hb.failed == []
            assert hb.health == {inst.id: False}
            await asyncio.sleep(0.5)   # the restart policy leaves it stopped
            assert proc.pid is None and not proc.supervised
            st, out = await cl.act(inst.id, "drain")
            assert (st, out["state"]) == (200, "stopped")
            # start: runs again, then a second start is a no-op
            st, out = await cl.act(inst.id, "start")
            assert (st, out) == (202, {"instance": inst.id, "action": "start",
                                       "state": "starting"})
            await await_until(lambda: inst.healthy, 20, "ready again")
            assert proc.pid not in (None, pid)
            assert cl.a.heartbeat().stopped == []
            assert await cl.act(inst.id, "start") == (200, {"instance": inst.id,
                                                            "action": "start",
                                                            "state": "ready"})
    run_uvloop(go(), 90)


def test_stop_start_restart_and_refusals(tmp_path: Path) -> None:
    async def go() -> None:
        async with Cluster(sim_node(tmp_path, 2)) as cl:
            a, b = cl.inst(0), cl.inst(1)
            # 404 / 400
            st, out = await cl.act("n1/sim/9", "stop")
            assert st == 404 and "n1/sim/9" in out["error"]["message"]
            st, out = await cl.act(a.id, "pause")
            assert st == 404 and "drain" in out["error"]["message"]
            st, out = await cl.act(a.id, "drain", {"timeout_s": -1})
            assert st == 400 and out["error"]["message"].startswith("body.timeout_s:")
            assert out["error"]["param"] == "timeout_s"
            st, out = await cl.act(a.id, "restart", [1])
            assert st == 400 and "expected a JSON object" in out["error"]["message"]
            st, out = await cl.post(f"{INSTANCES_PREFIX}{a.id}/stop", raw=b"{")
            assert st == 400
            # the id percent-encoded works too
            st, out = await cl.act(a.id.replace("/", "%2F"), "start")
            assert (st, out["state"]) == (200, "ready")

            # restart without a drain: a new process, ready again
            pid_b = b.processes[0].pid
            st, out = await cl.act(b.id, "restart", {"drain": False})
            assert (st, out) == (202, {"instance": b.id, "action": "restart",
                                       "state": "stopped"})
            assert cl.a.heartbeat().stopped == [b.id]
            st, out = await cl.act(b.id, "start")   # a restart under way
            assert st == 409 and "restart" in out["error"]["message"]
            await await_until(lambda: b.healthy and b.action is None, 20, "restarted")
            assert b.processes[0].pid not in (None, pid_b)
            assert not pid_alive(pid_b or 0)

            # a long drain: start / restart refused (409), stop overrides it at once
            pid_a = a.processes[0].pid
            st, _ = await cl.act(a.id, "drain", {"grace_s": 30})
            assert st == 202
            for action in ("start", "restart"):
                st, out = await cl.act(a.id, action)
                assert st == 409, (action, out)
                assert out["error"]["code"] == 409 and "drain" in out["error"]["message"]
            t0 = time.monotonic()
            st, out = await cl.act(a.id, "stop")
            assert (st, out) == (200, {"instance": a.id, "action": "stop", "state": "stopped"})
            assert time.monotonic() - t0 < 10
            assert a.admin is AdminState.STOPPED and a.action is None and a.task is None
            assert not pid_alive(pid_a or 0)
            assert (await cl.act(a.id, "stop"))[0] == 200   # already stopped: no-op
            hb = cl.a.heartbeat()
            assert hb.stopped == [a.id] and hb.failed == [] and hb.health[b.id]

            # restart of a stopped instance starts it; then a restart with a drain
            st, out = await cl.act(a.id, "restart")
            assert (st, out["state"]) == (202, "starting")
            await await_until(lambda: a.healthy, 20, "started by restart")
            pid_a = a.processes[0].pid
            st, out = await cl.act(a.id, "restart", {"grace_s": 0.05, "timeout_s": 5})
            assert (st, out["state"]) == (202, "draining")
            await await_until(lambda: a.healthy and a.action is None, 20, "drained and back")
            assert a.processes[0].pid not in (None, pid_a)
            assert b.processes[0].supervised and b.healthy   # the other one never moved
            status = await cl.get("/v1/instances")
            assert [i["admin_state"] for i in status["instances"]] == ["running", "running"]
    run_uvloop(go(), 90)


def test_start_gives_a_failed_engine_a_fresh_restart_budget(tmp_path: Path) -> None:
    """An engine the supervisor gave up on (restart policy ``never``) runs again on start."""
    async def go() -> None:
        node = NodeConfig(name="n1", log_dir=str(tmp_path / "logs"), engines=[dict(
            name="fake", kind="sim", model="m", count=1, base_port=free_ports(),
            launcher=FAKE_LAUNCHER, health_interval_s=0.05, stop_timeout_s=2,
            engine_config={"exit_after": 2.0}, restart={"policy": "never"})])
        async with Cluster(node) as cl:
            inst = cl.inst(0)
            await await_until(lambda: inst.processes[0].failed, 20, "given up")
            assert cl.a.heartbeat().failed == [inst.id]
            st, out = await cl.act(inst.id, "start")
            assert (st, out["state"]) == (202, "starting")
            await await_until(lambda: inst.healthy, 20, "running again")
            assert cl.a.heartbeat().failed == []
    run_uvloop(go(), 60)


def test_openapi_document_is_served_and_in_docs(tmp_path: Path) -> None:
    async def go() -> dict[str, Any]:
        node = NodeConfig(name="n1", log_dir=str(tmp_path / "logs"), engines=[dict(
            name="fake", kind="sim", model="m", count=1, base_port=free_ports(),
            launcher=FAKE_LAUNCHER, health_interval_s=0.05, stop_timeout_s=2)])
        async with Cluster(node) as cl:
            served: dict[str, Any] = await cl.get("/openapi.json")
            router = cl.a._route()
        paths = served["paths"]
        # every route of the router is documented with its method
        for path, by_method in router._routes.items():
            for method in by_method:
                assert method.decode().lower() in paths.get(path, {}), (method, path)
        for prefix, by_method in router._prefixes:
            documented = [p for p in paths if p.startswith(prefix)]
            assert documented, prefix
            for method in by_method:
                assert all(method.decode().lower() in paths[p] for p in documented)
        return served

    served = run_uvloop(go(), 60)
    assert served == openapi_document()
    assert served["openapi"].startswith("3.1")
    assert DOC.exists(), f"missing {DOC}; write it with: {REGENERATE}"
    assert json.loads(DOC.read_text()) == served, f"{DOC} is out of date; run: {REGENERATE}"


def test_motor_up_gives_every_node_a_management_port() -> None:
    """``motor up``: a node without ``mgmt_port`` gets 0 (any free port), so the controller
    can reach its lifecycle API; a port of the config is kept."""
    from motor.config import load_default_config
    from motor.up import with_management_ports
    cfg = load_default_config("pd")
    assert with_management_ports(cfg).nodes[0].mgmt_port == 0
    data = cfg.model_dump(mode="json")
    data["nodes"][0]["mgmt_port"] = free_ports()
    kept = type(cfg).model_validate(data)
    assert with_management_ports(kept).nodes[0].mgmt_port == data["nodes"][0]["mgmt_port"]
