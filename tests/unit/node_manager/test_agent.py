"""NodeAgent against an in-process controller: register, heartbeat, controller down / restarted."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest

from motor.config.schema import ControllerConfig, NodeConfig
from motor.controller.server import ControllerServer
from motor.node_manager.agent import NodeAgent
from motor.protocol.instances import InstanceState as S

from .helpers import FAKE_LAUNCHER, await_until, free_ports, run_uvloop


def node_cfg(tmp: Path, count: int = 2) -> NodeConfig:
    base = free_ports(count)
    return NodeConfig(name="n1", log_dir=str(tmp / "logs"), engines=[dict(
        name="fake", kind="sim", model="m", count=count, base_port=base, launcher=FAKE_LAUNCHER,
        health_interval_s=0.05, stop_timeout_s=2,
        restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.2})])


def states(srv: ControllerServer) -> dict[str, S]:
    return {i.id: i.state for i in srv.registry.table().instances}


def test_agent_lifecycle_with_controller_down_then_restarted(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def go() -> None:
        cport = free_ports()
        ccfg = ControllerConfig(port=cport, heartbeat_timeout_s=2, remove_after_s=5)
        agent = NodeAgent(node_cfg(tmp_path), f"http://127.0.0.1:{cport}",
                          heartbeat_interval_s=0.1, mgmt_port=0)
        await agent.start()  # the controller is not up yet
        await await_until(lambda: all(i.healthy for i in agent.instances), what="engines healthy")
        assert not agent.registered
        srv = ControllerServer(ccfg)
        await srv.start(port=cport)
        await await_until(lambda: states(srv) == {"n1/fake/0": S.READY, "n1/fake/1": S.READY},
                          what="registered ready")
        # controller restarts: empty registry -> known:false -> the agent registers again
        await srv.stop()
        srv = ControllerServer(ccfg)
        await srv.start(port=cport)
        await await_until(lambda: states(srv) == {"n1/fake/0": S.READY, "n1/fake/1": S.READY},
                          what="registered again")
        from motor.http import Client
        c = Client()
        st, body = await c.get_json_bytes("127.0.0.1", agent.mgmt_port or 0, "/v1/instances", 5)
        assert st == 200 and b"n1/fake/0" in body
        st, body = await c.get_json_bytes("127.0.0.1", agent.mgmt_port or 0, "/metrics", 5)
        assert b'motor_node_engine_healthy{instance="n1/fake/0",process="n1-fake-0"} 1.0' in body
        c.close()
        pids = [p.pid for i in agent.instances for p in i.processes]
        await agent.stop()
        assert states(srv) == {}
        assert all(p.pid is None for i in agent.instances for p in i.processes)
        assert all(pid is not None for pid in pids)
        await srv.stop()
    run_uvloop(go())
    outage_logs = [r for r in caplog.records if "logged once per outage" in r.getMessage()]
    # once per outage, at WARNING: the restart (it may or may not fall between two beats)
    assert len(outage_logs) <= 1 and all(r.levelno == logging.WARNING for r in outage_logs)
    # the controller not up yet at start-up: INFO, once (within the grace period)
    early = [r for r in caplog.records if "not reachable yet" in r.getMessage()]
    assert len(early) == 1 and early[0].levelno == logging.INFO


def test_busy_engine_port_reported_unhealthy_then_recovers(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Another process on an engine's port: not launched, failed + reason at the controller,
    never ready through the foreign server; once the port is freed the engine starts."""
    caplog.set_level(logging.INFO)

    async def go() -> None:
        from motor.http import HttpServer
        foreign_requests = 0

        async def handle(req: object, resp: object) -> None:
            nonlocal foreign_requests
            foreign_requests += 1
            resp.send(200, b"{}")  # type: ignore[attr-defined]
        cfg = node_cfg(tmp_path, count=1)
        port = cfg.engines[0].base_port
        foreign = HttpServer(handle)
        await foreign.listen("127.0.0.1", port)
        cport = free_ports()
        srv = ControllerServer(ControllerConfig(port=cport))
        await srv.start(port=cport)
        agent = NodeAgent(cfg, f"http://127.0.0.1:{cport}", heartbeat_interval_s=0.1)
        await agent.start()
        msg = f"port {port} on 127.0.0.1 is already in use by another process"
        await await_until(lambda: states(srv) == {"n1/fake/0": S.UNHEALTHY}, what="unhealthy")
        inst = srv.registry.table().instances[0]
        assert msg in inst.reason
        hb = agent.heartbeat()
        assert hb.health == {"n1/fake/0": False} and hb.failed == ["n1/fake/0"]
        assert msg in hb.reasons["n1/fake/0"]
        assert hb.engines["n1/fake/0"].state == "port_busy"
        assert foreign_requests == 0
        assert agent.instances[0].processes[0].pid is None
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("n1/fake/0" in m and msg in m for m in errors), errors
        await foreign.shutdown(drain_timeout_s=0.1)
        await await_until(lambda: states(srv) == {"n1/fake/0": S.READY}, what="ready")
        assert foreign_requests == 0
        await agent.stop()
        await srv.stop()
    run_uvloop(go())


def _cfg_no_log_dir(tmp: Path, **engine: object) -> NodeConfig:
    base = free_ports()
    e: dict[str, object] = dict(
        name="fake", kind="sim", model="m", count=1, base_port=base, launcher=FAKE_LAUNCHER,
        health_interval_s=0.05, stop_timeout_s=2,
        restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.2})
    e.update(engine)
    return NodeConfig(name="n1", engines=[e])


async def _run_agent(cfg: NodeConfig, until: str) -> NodeAgent:
    cport = free_ports()
    srv = ControllerServer(ControllerConfig(port=cport))
    await srv.start(port=cport)
    agent = NodeAgent(cfg, f"http://127.0.0.1:{cport}", heartbeat_interval_s=0.1)
    await agent.start()
    if until == "healthy":
        await await_until(lambda: all(i.healthy for i in agent.instances), what="healthy")
    else:
        await await_until(lambda: all(i.failed for i in agent.instances), what="failed")
    await agent.stop()
    await srv.stop()
    return agent


def test_temp_log_dir_removed_on_clean_stop(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOTOR_ENGINE_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    agent = run_uvloop(_run_agent(_cfg_no_log_dir(tmp_path), "healthy"))
    assert agent.log_dir is not None and agent.log_dir.startswith(str(tmp_path / "motor-n1-logs-"))
    assert not os.path.exists(agent.log_dir)


def test_temp_log_dir_kept_when_an_engine_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.delenv("MOTOR_ENGINE_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = _cfg_no_log_dir(tmp_path, engine_config={"exit_after": 0.1},
                          restart={"policy": "never"})
    agent = run_uvloop(_run_agent(cfg, "failed"))
    assert agent.log_dir is not None
    assert os.path.exists(os.path.join(agent.log_dir, "n1-fake-0.log"))
    kept = [r.getMessage() for r in caplog.records if "engine logs kept in" in r.getMessage()]
    assert len(kept) == 1 and agent.log_dir in kept[0] and "n1-fake-0" in kept[0]


def test_engine_log_dir_from_the_environment(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    env_dir = tmp_path / "run" / "engines"
    monkeypatch.setenv("MOTOR_ENGINE_LOG_DIR", str(env_dir))
    agent = run_uvloop(_run_agent(_cfg_no_log_dir(tmp_path), "healthy"))
    assert agent.log_dir == str(env_dir)
    assert os.path.exists(env_dir / "n1-fake-0.log")  # not a temp dir: kept
    # the node config's log_dir and an explicit log_dir come first
    assert NodeAgent(node_cfg(tmp_path, 1), "http://127.0.0.1:1").log_dir == str(tmp_path / "logs")
    assert NodeAgent(_cfg_no_log_dir(tmp_path), "http://127.0.0.1:1",
                     log_dir=str(tmp_path / "x")).log_dir == str(tmp_path / "x")


def test_deregister_quiet_when_the_controller_stopped_first(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def go() -> None:
        cport = free_ports()
        srv = ControllerServer(ControllerConfig(port=cport))
        await srv.start(port=cport)
        agent = NodeAgent(node_cfg(tmp_path, 1), f"http://127.0.0.1:{cport}",
                          heartbeat_interval_s=0.1)
        await agent.start()
        await await_until(lambda: states(srv) == {"n1/fake/0": S.READY}, what="ready")
        await srv.stop()  # `motor up` stops the controller last, but it may be gone already
        await agent.stop()
    run_uvloop(go())
    msgs = [r for r in caplog.records if r.name == "motor.node_manager.agent"
            and "deregister" in str(r.msg)]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO
    assert "already gone, not deregistered" in msgs[0].getMessage()
    # (a heartbeat between the two stops may log the outage; that is not the deregistration)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "deregister" in str(r.msg)]
